"""The Better Compute client: `better-compute reserve|extend|…` (main) and the MCP server (mcp_server)."""
