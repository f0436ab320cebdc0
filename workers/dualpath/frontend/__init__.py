"""OpenAI-style HTTP frontend: tokenize, route through the scheduler, stream from decode."""
