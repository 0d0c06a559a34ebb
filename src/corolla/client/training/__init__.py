"""Training and embeddings through the swarm: a chain as a differentiable function, trainable prompts."""
