"""Scheduler: the pure policy (`policy/`) and its gRPC shell (`service.py`)."""
