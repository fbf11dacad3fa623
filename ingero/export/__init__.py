"""Exports of trace data for other tools (Perfetto / Chrome Trace Event JSON)."""
