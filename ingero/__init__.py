"""ingero — GPU causal observability.

Every GPU node runs an identical agent that traces CUDA / driver / NCCL calls (eBPF uprobes) and host
kernel events into a local SQLite store and serves a TLS 1.3 query API; from a laptop one command fans
SQL or ``explain`` out to every node and merges the answers with a ``node`` column.
"""

__version__ = "0.1.0"
API_VERSION = 1  # the agent HTTP API under /api/v1 (agents say it in /info; the fleet client checks it)
