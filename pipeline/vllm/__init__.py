"""vLLM as a component, never imported: its venv (env.py), a server process (server.py), HTTP (client.py),
and the server's arguments for a target and draft (spec_config.py)."""
