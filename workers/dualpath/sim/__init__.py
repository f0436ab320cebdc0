"""Cluster-scale discrete-event simulator of DualPath policies (`dualpath sim`)."""
