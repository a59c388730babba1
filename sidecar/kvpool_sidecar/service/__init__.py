"""The sidecar service: HTTP API over the pool, Prometheus metrics, hot reload of the config file."""
