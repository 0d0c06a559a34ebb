"""Helpers for tests that run real local swarms: server layouts, client connections, references."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from corolla.client.client import Client, ServedModel
from corolla.client.model import DistributedModelForCausalLM
from corolla.config import ClientConfig
from corolla.launch.forked import fork_peer
from corolla.launch.local import LocalSwarm
from corolla.swarm.dht import RemoteSpan

# One swarm offers chains of 1, 2 and 3 servers: a client restricted to some servers (allowed_servers)
# routes through exactly those, using part of a server's span where needed.
TINY_SPANS = [(0, 6), (0, 3), (3, 6), (0, 2), (2, 4)]
TINY_CHAINS = {1: [0], 2: [1, 2], 3: [3, 4, 2]}
SMOL_SPANS = [(0, 30), (0, 15), (15, 30), (0, 10), (10, 20)]
SMOL_CHAINS = {1: [0], 2: [1, 2], 3: [3, 4, 2]}
SMOL_LIMITS = ["--inference-max-length", "1024", "--max-batch-size", "8", "--max-cache-tokens", "8192"]


def one_worker_each(names: list[str]) -> list:
    """Fixture params whose tests each run in one xdist worker (`--dist loadgroup`): a module-scoped swarm
    per param starts once, not once in every worker that happens to run one of its tests."""
    return [pytest.param(name, marks=pytest.mark.xdist_group(name)) for name in names]


def client_config(swarm: LocalSwarm, servers: list[int] | None = None, **overrides) -> ClientConfig:
    allowed = tuple(swarm.servers[i].peer_id for i in servers) if servers is not None else None
    return swarm.client_config(**{"allowed_servers": allowed, "routing_timeout": 20.0, **overrides})


def connect(
    model: str | Path,
    swarm: LocalSwarm,
    servers: list[int] | None = None,
    tuning_mode: str | None = None,
    pre_seq_len: int = 0,
    **overrides,
) -> DistributedModelForCausalLM:
    return DistributedModelForCausalLM.from_pretrained(
        str(model),
        config=client_config(swarm, servers, **overrides),
        tuning_mode=tuning_mode,
        pre_seq_len=pre_seq_len,
    )


async def fresh_spans(swarm: LocalSwarm, prefix: str = "tiny-llama", num_blocks: int = 6) -> list[RemoteSpan]:
    """The servers in the swarm's DHT as a new client reads them (announced records, each server pinged)."""
    client = await Client.connect(client_config(swarm), prefix, ServedModel(num_blocks))
    try:
        return await client.swarm.view.refresh()
    finally:
        await client.shutdown()


def reference_generate(reference, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
    """transformers' own greedy generate (explicit attention mask: SmolLM2's pad token is its EOS)."""
    with torch.no_grad():
        return reference.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, **kwargs
        )


async def wait_until(predicate, timeout: float, interval: float = 0.2):
    """Poll an async predicate until it returns a truthy value; returns that value or the last one."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = await predicate()
        if value or loop.time() > deadline:
            return value
        await asyncio.sleep(interval)


def assert_boundaries_match(model, session, outputs: torch.Tensor, hidden_states) -> None:
    """After a session's first step (its outputs), each hop's outputs equal transformers' hidden states
    at that block boundary: a hop's outputs are what the next hop received (its history), the last hop's
    the step's outputs, compared after the final norm as transformers gives them (fp32: within 1e-4)."""
    links = session.chain.links
    found = [link.history.inputs for link in links[1:]] + [model.head.norm(outputs)]
    for link, got in zip(links, found, strict=True):
        torch.testing.assert_close(got, hidden_states[link.hop.end], atol=1e-4, rtol=1e-4)


def run_corolla(
    *commands: list[str], timeout: float = 120, env: dict | None = None, netns: str | None = None
) -> list[subprocess.CompletedProcess]:
    """Run `corolla` commands at once, each forked from the process that has imported corolla already
    (launch/forked.py: the same command line, without paying for the imports again), in network namespace
    `netns` if given; one still running after `timeout` fails the test (its process group, with its DHT
    process and daemon, is killed)."""
    folder = Path(tempfile.mkdtemp(prefix="corolla-cli-"))
    env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    runs = [
        fork_peer(args, folder / f"{i}.out", env, err_path=folder / f"{i}.err", netns=netns)
        for i, args in enumerate(commands)
    ]
    results = []
    try:
        for i, (run, args) in enumerate(zip(runs, commands, strict=True)):
            try:
                code = run.wait(timeout)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"corolla {' '.join(args)} still ran after {timeout:.0f}s") from None
            out, err = ((folder / f"{i}.{name}").read_text(errors="replace") for name in ("out", "err"))
            results.append(subprocess.CompletedProcess(args, code, out, err))
    finally:
        for run in runs:
            run.kill_group()
            run.wait()
        shutil.rmtree(folder, ignore_errors=True)
    return results
