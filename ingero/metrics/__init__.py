"""Prometheus and OTLP export of the recorder's metrics (definitions in :mod:`ingero.metrics.registry`)."""
