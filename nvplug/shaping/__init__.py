"""What is advertised: the config's resource names applied to the node's GPUs."""
