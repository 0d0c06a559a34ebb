"""The blocks a server starts with: those its configuration names, or as many as its memory budget holds,
where the swarm needs them most (swarm/policy/placement.py weighs the servers there by their speed)."""

from __future__ import annotations

import logging

import torch
from hivemind import DHT

from corolla.config import ServerConfig
from corolla.errors import InvalidRequest
from corolla.models.devices import free_memory
from corolla.models.model_config import ModelConfig
from corolla.server.hosting.backend import BUDGET_CACHE_TOKENS
from corolla.swarm.policy.placement import blocks_for_budget, choose_blocks
from corolla.swarm.records.block_records import placed_servers

logger = logging.getLogger(__name__)


async def first_blocks(
    config: ServerConfig,
    model: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    dht: DHT,
    dht_prefix: str,
    peer_id: str,
    weight: float,
) -> tuple[int, int]:
    """[start, end) for a server of speed `weight` (blocks per second) joining the swarm as the DHT
    shows it now."""
    if config.blocks is not None:
        return config.blocks
    total = model.num_hidden_layers
    num_blocks = config.num_blocks or blocks_in_budget(config, model, dtype, device)
    if num_blocks < 1:
        raise InvalidRequest("the memory budget does not hold a single block (see --memory-budget)")
    others = await placed_servers(dht, dht_prefix, total, peer_id)
    others.pop(peer_id, None)
    forbidden = model.kv_sharing.forbidden_cuts
    return choose_blocks(others.values(), min(num_blocks, total), total, weight, forbidden)


def blocks_in_budget(
    config: ServerConfig, model: ModelConfig, dtype: torch.dtype, device: torch.device
) -> int:
    """The blocks, with their cache, that the memory budget (default: half the free memory) holds."""
    budget = config.memory_budget or int(free_memory(device) * 0.5)
    cache = config.engine.max_cache_tokens or BUDGET_CACHE_TOKENS
    num_blocks = blocks_for_budget(model, dtype.itemsize, budget, cache, config.quantize)
    message = "A memory budget of %.0f MB on %s holds %d blocks (with %d cache tokens)"
    logger.info(message, budget / 2**20, device, num_blocks, cache)
    return num_blocks
