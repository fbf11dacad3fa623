"""The agent's HTTP API: ASGI app (``app``), endpoints, worker pool and server start-up."""
