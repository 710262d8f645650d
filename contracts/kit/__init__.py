"""The hosting kit: what every component process needs to start, connect and report."""
