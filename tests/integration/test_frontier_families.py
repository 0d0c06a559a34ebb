"""This year's attention layouts served by real `corolla server` processes, against transformers' own
`generate` on the same tiny checkpoint: alone, as eight sessions at once, with speculative tree steps that
reject part of their draft, and through a kill -9 of the server a session runs on. Every family's
servers join one public peer (`corolla dht`), as in a swarm serving several models.

deepseek_v3: multi-head latent attention (the cache holds the compressed latent and the rotary key,
expanded by the layer after each read) and grouped MoE routing; its checkpoint's MTP layer drafts too.
mistral_large4: the same latent attention, whose keys an indexer picks per query (its keys cached beside
the latent; each row ranked alone), NoPE layers and a learned rotary scaling; its causal LM exists only in
transformers' multimodal wrapper, built with its vision tower left unloaded (DeepSeek-V3.2 and GLM-5
share this sparse attention: proven through loopback servers).
qwen3_5: Gated DeltaNet linear attention 2:1 with full attention (a recurrent and a convolution state
per session row, restored from snapshots when a draft is rejected); the first span ends on its
attention layer, the second starts on linear ones.
gemma3n: a last layer that attends with the one before's keys and values (the second span starts on
that source, the only cut before it that keeps them together), per-layer inputs and 4 parallel residual
streams (AltUp) beside the hidden states (models/handoff.py): what travels between the servers is 4.75
times the hidden size wide.
glm5_next: KDA linear attention 1:1 with sparse latent attention whose indexer ranks pools of keys and
finds causality from positions (tree steps run path by path), hyper-connection streams, no rotary at
all; a causal LM only in its multimodal wrapper. The cut falls between a linear and an indexed layer.
llama4: chunked attention (each query sees its own chunk of 4 positions) with rotary, and global NoPE layers
whose queries are scaled by position (from position 4 on here): rows and a tree's paths are run one at a
time through those layers, each counted from its own position.
lfm2_moe: LFM2's short convolutions beside attention, MoE after a dense block, its rotary under another
name (`pos_emb`).
longcat_flash: each layer two latent-attention sublayers with a cache each (a block of two cache layers)
and a MoE with identity experts whose output skips to the layer's end.
zaya: attention whose queries and keys pass a causal convolution and half of whose values are the previous
token's (a convolution and a recurrent state beside the keys and values), sliding in every other layer,
and routers that add the previous layer's router state, which travels between the servers beside the
hidden states.
zamba2: Mamba-2 layers, and hybrid layers whose shared attention blocks (two, each stored once and tied
across layers, with per-layer adapters) read the embeddings' output, which travels beside the hidden
states; the second span's last block reads the weights the checkpoint stores under block 1.
deepseek_v4: compressed sparse attention (an entry every 2 tokens, an indexer's top 3 of them), heavily
compressed attention (every 4) and sliding attention, each layer's cache transformers' own object per
session row (window, compressed entries, the compressors' buffers and overlap); hyper-connection streams
and the token ids (its first layers' experts are picked by them) travel between the servers.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from corolla.config import SpeculationConfig
from corolla.decoding.mtp import mtp_layers
from corolla.launch.local import READY_DHT, LocalSwarm, PeerProcess
from corolla.models.model_config import ModelConfig
from swarm_helpers import connect, one_worker_each, reference_generate
from tiny_models import load_reference

# Mistral 4 (latent attention too, the same cache path) is proven through loopback servers
# (tests/unit/client/test_families.py): real processes for one latent family keep the suite's time
# Mamba (Jamba, Nemotron-H) and convolutions (LFM2) keep their states the same way (engine/states.py),
# proven through loopback servers too
# HY-V4 (sparse latent attention as Mistral Large 4's, hyper-connection streams as GLM-5-Next's and
# DeepSeek-V4's) and Gemma 4 (keys and values shared across layers as Gemma 3n's) bring no mechanism these do
# not carry between real processes: both are proven through loopback servers (test_families, and
# test_recurrent_states for trees)
FRONTIER = [
    "deepseek_v3",
    "mistral_large4",
    "qwen3_5",
    "gemma3n",
    "glm5_next",
    "llama4",
    "lfm2_moe",
    "longcat_flash",
    "zaya",
    "zamba2",
    "deepseek_v4",
]
DHT_ARGS = ["dht", "--host", "127.0.0.1", "--no-nat-port-map"]
SPANS = [(0, 3), (3, 6), (3, 6)]  # the second half twice: one replica survives the kill
SHARING = [(0, 4), (4, 6), (4, 6)]  # block 5 reads block 4's keys and values
SPANS_OF = {"gemma3n": SHARING}
NEW_TOKENS = 10  # greedy tokens each generation compares (the kill falls at the 5th)
PROMPTS = [torch.randint(3, 300, (1, 5 + i), generator=torch.Generator().manual_seed(i)) for i in range(8)]
# a prompt that repeats itself
REPEATING = torch.randint(3, 300, (1, 6), generator=torch.Generator().manual_seed(9)).repeat(1, 3)


@pytest.fixture(scope="module")
def public_peer(tmp_path_factory):
    """The one public peer (`corolla dht`) of a swarm serving all the families, each its own model."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    dht = PeerProcess("dht", DHT_ARGS, tmp_path_factory.mktemp("dht") / "dht.log", env)
    try:
        yield [dht.wait_for(READY_DHT, 60).group(1)]
    finally:
        dht.stop()


@pytest.fixture(scope="module", params=one_worker_each(FRONTIER))
def served(request, tiny_models, public_peer):
    path = tiny_models[request.param]
    reference = load_reference(path)
    expected = [
        reference_generate(reference, ids, max_new_tokens=NEW_TOKENS) for ids in [*PROMPTS, REPEATING]
    ]
    spans = SPANS_OF.get(request.param, SPANS)
    swarm = LocalSwarm(str(path), spans, server_args=["--announce-period", "5"])
    swarm.initial_peers = public_peer
    with swarm:
        yield path, swarm, expected


@pytest.fixture(scope="module")
def plain(served):
    """A client of the family's swarm that does not speculate (the first and the last test's)."""
    path, swarm, _ = served
    with connect(path, swarm) as model:
        yield model


def test_alone_and_eight_at_once_the_tokens_are_transformers(served, plain):
    _, _, expected = served
    model = plain
    assert torch.equal(model.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS), expected[0])

    async def together():
        async def one(ids):
            new = [tokens[:, None] async for tokens in model.agenerate(ids, max_new_tokens=NEW_TOKENS)]
            return torch.cat([ids, *new], dim=1)

        return await asyncio.gather(*(one(ids) for ids in PROMPTS))

    for index, tokens in enumerate(model.runtime.run(together())):
        assert torch.equal(tokens, expected[index]), f"prompt {index} differs when batched"


def test_speculative_trees_that_reject_part_of_their_draft_give_the_same_tokens(served, tiny_models):
    path, swarm, expected = served
    # another random model of the same vocabulary drafts trees of width 2: most of its tokens are rejected
    draft = str(tiny_models["llama"])
    speculation = SpeculationConfig(draft=draft, width=2, max_depth=3, adaptive=False)
    with connect(path, swarm, speculation=speculation) as model:
        for index, ids in ((1, PROMPTS[1]), (-1, REPEATING)):
            assert torch.equal(model.generate(ids, max_new_tokens=NEW_TOKENS), expected[index])
        stats = model.speculator.stats
        assert stats.drafted > stats.accepted  # some of the drafts were rejected
    if mtp_layers(ModelConfig.from_folder(path)):  # DeepSeek-V3's own MTP layer drafts, pipelined
        speculation = SpeculationConfig(draft="mtp", max_depth=3, adaptive=False)
        with connect(path, swarm, speculation=speculation) as model:
            assert torch.equal(model.generate(REPEATING, max_new_tokens=NEW_TOKENS), expected[-1])
            assert model.speculator.stats.drafted > 0


def test_a_server_killed_mid_generation_is_replaced_and_the_tokens_do_not_change(served, plain):
    _, swarm, expected = served
    ids = PROMPTS[2]
    model = plain
    with model.inference_session(ids.shape[1] + NEW_TOKENS) as session:
        seen = []

        def on_token(_):
            seen.append(None)
            if len(seen) == NEW_TOKENS // 2:
                victim = next(s for s in swarm.servers if s.peer_id == session.route[-1].peer_id)
                victim.kill_group()

        tokens = model.generate(ids, session=session, max_new_tokens=NEW_TOKENS, streamer=on_token)
        assert session.num_failovers == 1
    assert torch.equal(tokens, expected[2])
