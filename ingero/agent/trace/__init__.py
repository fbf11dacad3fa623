"""eBPF tracer: BPF C (``bpf/``), the probe loader (the only module importing bcc), library discovery,
ring buffer, recorder, live-view model and ``ingero check``."""
