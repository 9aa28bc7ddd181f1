"""Test-only stand-ins and helpers that do not ship in the wheel: the API server, the DRA kubelet, nspawn, podman."""
