"""Talking to one server: its streams, its pings, a silent hop noticed (the only code that opens streams)."""
