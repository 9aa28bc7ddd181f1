"""What operators see and say: /healthz, /status, /metrics and POST /heal, and their client."""
