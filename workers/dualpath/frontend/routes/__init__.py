"""The HTTP routes, one router per surface: `completions` (/v1/completions and
/v1/chat/completions) and `service` (/v1/models, /health, /metrics)."""
