"""The pure core: GPUs, events, health rules and the node state. No I/O."""
