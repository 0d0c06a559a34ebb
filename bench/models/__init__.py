"""Model families, shapes and precisions: every Hugging Face family through a swarm, real models' shapes
(latent, linear and sparse attention, MoE experts) with random weights, quantized servers and what costs
them agreement with fp32, and a server's memory against the whole model's."""
