"""transformers' entry points on corolla's generation: what `generate` takes and returns, beam search, what
code written for a transformers model reads from one."""
