"""Helpers with no knowledge of GPUs or Kubernetes: atomic files and the backoff policy."""
