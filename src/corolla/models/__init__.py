"""Model families: load a span of blocks (or a client's head) from a checkpoint and run it."""
