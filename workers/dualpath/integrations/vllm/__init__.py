"""DualPath inside vLLM: the KV connector (`connector.DualPathConnector`) and the one definition
of its `--kv-transfer-config` (`config`), shared by the operator, `dualpath up` and the connector.
"""
