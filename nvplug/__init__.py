"""nvplug: a Kubernetes device plugin for NVIDIA GPUs, run as a host service."""

__version__ = "0.1.0"
