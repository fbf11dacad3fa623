"""The MCP server: ingero's read-only tools for AI assistants (``ingero mcp``)."""
