"""DualPath runtime: config, KV store, engine, transfer, scheduler, frontend, local cluster, sim."""

__version__ = "0.1.0"
