"""DualPath inside an unmodified vLLM (docs/vllm.md).

- `connector.DualPathConnector`: vLLM's KV connector API v1, loaded by
  `kv_transfer_config.kv_connector_module_path = "dualpath.integrations.vllm.connector"`;
- `connector_config.ConnectorConfig`: its `kv_connector_extra_config`, one dataclass both ends use;
- `plan`: the route a request carries and the per-step plans (receiver, sender, loads, saves);
- `nixl.KvAgent`: NIXL over vLLM's own paged cache, between a decode and a prefill instance;
- `rendezvous`: the loopback question a decode adapter asks its vLLM's connector;
- `blocks`: the one mapping between vLLM's KV blocks and the store's (pure);
- `cache`: vLLM's CPU paged KV cache layout, checked against vLLM's own kernel;
- `server`: the `vllm serve` command of a worker on engine vllm (`dualpath.worker.vllm`).
The checkpoint both engines load is written by `dualpath model write` (`dualpath.local.model`).
"""
