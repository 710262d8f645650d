"""Worker processes by role: the aggregated, decode and prefill shells, each written once
against the engine interface, and the registry that says which engine folder serves
each ``engine`` name (see docs/architecture.md, "The worker layer")."""
