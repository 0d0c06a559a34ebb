"""The hosted span: its weights and engine, its sessions' cache, how fast it runs."""
