"""DualPath operator: pure builders render a DualPathCluster into children; kopf applies them."""
