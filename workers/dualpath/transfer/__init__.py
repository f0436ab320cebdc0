"""KV transfer between worker processes: the NIXL transfer engine, its registered buffer
pool, and the emulated compute link shared by traffic classes (docs/design.md sections 3 and 5)."""
