"""The client: remote span sessions, inference sessions over a chain, the distributed model, generation."""
