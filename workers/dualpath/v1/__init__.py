"""Generated gRPC contracts (from proto/dualpath/v1, by `make proto`)."""
