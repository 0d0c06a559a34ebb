"""A swarm peer serving a contiguous span of a model's blocks."""
