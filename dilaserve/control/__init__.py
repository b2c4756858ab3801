"""The control plane: pure Python, no torch, no clock. Driven by the simulator and the cluster."""
