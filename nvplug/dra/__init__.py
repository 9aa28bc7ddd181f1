"""Dynamic Resource Allocation: a DRA kubelet plugin served from the same state as the device plugin."""
