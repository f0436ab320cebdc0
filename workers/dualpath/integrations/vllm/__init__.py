"""DualPath inside an unmodified vLLM (docs/vllm.md).

- `connector.DualPathConnector`: vLLM's KV connector API v1, loaded by
  `kv_transfer_config.kv_connector_module_path = "dualpath.integrations.vllm.connector"`;
- `blocks`: the one mapping between vLLM's KV blocks and the store's (pure);
- `cache`: vLLM's CPU paged KV cache layout, checked against vLLM's own kernel;
- `server`: the `vllm serve` command of a worker on engine vllm (`dualpath.worker.vllm`).
The checkpoint both engines load is written by `dualpath model write` (`dualpath.local.model`).
"""
