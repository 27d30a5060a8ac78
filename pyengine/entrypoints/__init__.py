"""User-facing entry points: the CLI (and, later, the server)."""
