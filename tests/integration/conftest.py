"""Local swarms of real processes on 127.0.0.1, shared by the integration tests."""

from __future__ import annotations

import os

import pytest
import torch

from corolla.launch.local import LocalSwarm
from swarm_helpers import SMOL_LIMITS, SMOL_SPANS, connect

SMOL_FIXTURES = {"smol_swarm", "smol_api", "smol_openai", "smol_client", "smol_reference"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which turns the marks into node ids
def pytest_collection_modifyitems(items):
    for item in items:
        if "integration" in str(item.fspath):
            item.add_marker(pytest.mark.slow)
        if SMOL_FIXTURES & set(getattr(item, "fixturenames", ())):
            # with pytest-xdist (make test: --dist loadgroup), the tests of the one shared SmolLM2 swarm
            # run in one worker, which starts that swarm once
            item.add_marker(pytest.mark.xdist_group("smol"))
        if item.fspath.basename == "test_nat.py":  # one NAT harness (its namespaces have fixed names)
            item.add_marker(pytest.mark.xdist_group("nat"))
    # the longest groups first: the NAT tests (mostly waiting out routers' and relays' timeouts) and the
    # shared swarm's tests each run in one worker, and started last they would end the run alone
    first = {"nat": 0, "smol": 1}
    items.sort(
        key=lambda item: min((first.get(m.args[0], 2) for m in item.iter_markers("xdist_group")), default=2)
    )


@pytest.fixture(scope="session")
def smol_swarm(smollm2_path, tmp_path_factory, worker_id):
    if worker_id != "master":  # under pytest-xdist: the first worker to start the swarm claims it
        claim = tmp_path_factory.getbasetemp().parent / "smol-swarm"
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            # pytest 9.2 loses the group (pytest-xdist issue 1386): each worker would start its own swarm
            pytest.fail("a second worker needs the SmolLM2 swarm: --dist loadgroup did not group its tests")
    logs = tmp_path_factory.mktemp("smol-swarm")  # kept after the run (pytest's own tmp): what failed, said
    with LocalSwarm(str(smollm2_path), SMOL_SPANS, server_args=SMOL_LIMITS, workdir=logs) as swarm:
        yield swarm


@pytest.fixture(scope="session")
def smol_reference(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smol_api(smol_swarm):
    """`corolla api` over smol_swarm, shared by the API, dashboard and README tests (test_api, which counts
    requests in the metrics, runs first). Its --max-model-len is the swarm's session limit."""
    process = smol_swarm.add_api(extra_args=["--max-model-len", "1024"])
    yield process
    process.stop()
    smol_swarm.apis.remove(process)


@pytest.fixture(scope="session")
def smol_openai(smol_api):
    """The official openai client of smol_api."""
    from openai import OpenAI

    return OpenAI(base_url=f"{smol_api.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def smol_client(smollm2_path, smol_swarm):
    model = connect(smollm2_path, smol_swarm)
    yield model
    model.shutdown()
