"""What lanes knows about llama-server, in one place: its flags (flags.py), the lines it
logs (logs.py) and its HTTP endpoints (endpoints.py). Pure: running it is the agent's job."""
