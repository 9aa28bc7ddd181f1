"""MPS run by the host service: the control daemons of sharing.mps, their directories and compute modes."""
