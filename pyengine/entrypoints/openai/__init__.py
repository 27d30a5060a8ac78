"""The OpenAI-compatible server: api_server (app, CLI), protocol (request bodies), serving (the
completion endpoints), metrics (Prometheus text)."""
