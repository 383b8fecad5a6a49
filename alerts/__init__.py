"""Event schemas and ids, Prometheus metrics, rules, Alertmanager and Grafana provisioning."""
