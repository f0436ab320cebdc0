"""Adapters that run DualPath's KV path inside other serving engines (vLLM: `integrations.vllm`)."""
