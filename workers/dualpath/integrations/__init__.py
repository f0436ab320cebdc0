"""DualPath inside other engines: the KV connector and tools of each (vllm/)."""
