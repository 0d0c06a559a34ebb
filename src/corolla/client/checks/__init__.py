"""Spot checks: results compared with other servers', disputes decided, liars banned."""
