"""CLI commands that drive the gateway server."""
