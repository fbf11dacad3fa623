"""One registry of typed tools (:mod:`ingero.tools.registry`), served by MCP (stdio, HTTP), the HTTP+JSON
tools API and the dashboard with the same answers and one error vocabulary (:mod:`ingero.tools.failures`)."""
