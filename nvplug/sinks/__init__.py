"""Sinks that write files for the node: the CDI spec, the NFD labels and the health state file."""
