"""Node agent: eBPF tracer (bcc, loaded lazily in probes.py only), API server, TLS/PKI helpers."""
