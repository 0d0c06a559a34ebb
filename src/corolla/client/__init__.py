"""The client, in layers (each module imports only those below it; see docs/architecture.md):
talking to one server (span_stream, peers); who serves what (estimates, bans, swarm_view, router);
chains of servers (hop_history, chain, passes); the inference session; spot checks (agreement, judge,
shadows, spot_checks); generation (head_batcher, speculative, generation), training and embeddings; the
composition root (client) and the model facade (model)."""
