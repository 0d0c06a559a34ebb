"""On a CUDA GPU (`pytest -m gpu`, `make gpu-check`): real `corolla server` processes computing on the GPU
in float32 give transformers' own greedy tokens on the same GPU, alone and as 8 sessions at once, for a
plain, a latent-attention MoE and a linear-attention family (bfloat16 speed is bench/gpu/check.py's)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from corolla.launch.local import LocalSwarm
from swarm_helpers import connect, one_worker_each, reference_generate
from tiny_models import load_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA"),
]
NEW_TOKENS = 12
PROMPTS = [torch.randint(3, 300, (1, 5 + i), generator=torch.Generator().manual_seed(i)) for i in range(8)]


@pytest.mark.parametrize("family", one_worker_each(["llama", "deepseek_v3", "qwen3_5"]))
def test_servers_on_the_gpu_give_transformers_tokens_on_the_gpu(tiny_models, family):
    path = tiny_models[family]
    reference = load_reference(path).to("cuda")
    expected = [reference_generate(reference, ids.cuda(), max_new_tokens=NEW_TOKENS).cpu() for ids in PROMPTS]
    server_args = ["--device", "cuda", "--dtype", "float32", "--max-cache-tokens", "4096"]
    with (
        LocalSwarm(str(path), [(0, 3), (3, 6)], server_args=server_args) as swarm,
        connect(path, swarm) as model,
    ):
        model.to("cuda")
        assert torch.equal(model.generate(PROMPTS[0].cuda(), max_new_tokens=NEW_TOKENS).cpu(), expected[0])

        async def together():
            async def one(ids):
                new = [t[:, None] async for t in model.agenerate(ids.cuda(), max_new_tokens=NEW_TOKENS)]
                return torch.cat([ids, *(t.cpu() for t in new)], dim=1)

            return await asyncio.gather(*(one(ids) for ids in PROMPTS))

        for index, tokens in enumerate(model.runtime.run(together())):
            assert torch.equal(tokens, expected[index]), f"prompt {index} differs when batched on the GPU"
