"""The OpenAI-compatible HTTP server: protocol (wire models), serving (logic), app (routes)."""
