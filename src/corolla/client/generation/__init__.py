"""Generation over a session: the one decode loop, speculative drafts, the LM head batched, reused
prefixes."""
