"""What an operator watches: Prometheus metrics, health endpoints, structured logs."""
