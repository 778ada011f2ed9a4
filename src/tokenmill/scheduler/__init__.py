"""Which tokens run each step and which KV blocks hold them: plain Python, no torch (tested in milliseconds)."""
