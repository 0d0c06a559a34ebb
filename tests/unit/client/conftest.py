"""Client tests without sockets: corolla's own servers in this process (tests/loopback.py), tiny models."""

from __future__ import annotations

import pytest

from loopback import LoopbackNetwork
from tiny_models import load_reference


@pytest.fixture(scope="session")
def llama(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def reference(llama):
    return load_reference(llama)


@pytest.fixture
async def network(llama):
    network = LoopbackNetwork(llama)
    yield network
    await network.close()
