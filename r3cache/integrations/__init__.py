"""Integrations: r3cache inside the systems its users run (each imports its framework)."""
