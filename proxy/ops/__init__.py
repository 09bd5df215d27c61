"""What operators see: logs, metrics, traces, the status page."""
