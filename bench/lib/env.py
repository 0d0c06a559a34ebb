"""The environment benchmarks run under, the flags several of them share, and how one re-runs itself.

Owns the environment defaults (applied by bench/__init__.py, so before any script imports torch), the
environment of the processes a benchmark starts in namespaces, the argument parser every script opens
with and the flag groups shared by several, and the command that runs a benchmark module again as a
child (the repository root as its working directory). Measures nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: `python -m bench...` runs from here
DEFAULTS = {"HF_HUB_OFFLINE": "1"}  # every model a benchmark loads is local (converted once)
# the peers and clients a benchmark starts in network namespaces: one thread each, logs as they come
CHILD = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def apply(defaults: dict[str, str]) -> None:
    """Set each variable unless the caller's environment already has it."""
    for name, value in defaults.items():
        os.environ.setdefault(name, value)


def parser(doc: str | None, *parents: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """A script's parser: its docstring as the help text, as written (with `parents`' flags), its usage
    line naming the command that runs it."""
    script = Path(sys.argv[0]).resolve().with_suffix("")
    prog = f"python -m {'.'.join(script.relative_to(ROOT).parts)}" if script.is_relative_to(ROOT) else None
    return argparse.ArgumentParser(
        prog=prog,
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=list(parents),
    )


def wan_flags() -> argparse.ArgumentParser:
    """The emulated internet's delay, and the hidden --client a script is given inside its client host."""
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--delay-ms", type=float, default=25.0, help="one-way delay between hosts")
    flags.add_argument("--client", nargs="+", help=argparse.SUPPRESS)  # internal: inside the client host
    return flags


def device_flags() -> argparse.ArgumentParser:
    """Where and in what precision the servers, the client's head and the reference compute."""
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--device", default="cpu", help="of the servers, the client's head and the reference")
    flags.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    return flags


def shape_flags(layers: int, new_tokens: int) -> argparse.ArgumentParser:
    """A real model's shapes with fewer layers: how many, the tokens decoded, the sessions' context."""
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--layers", type=int, default=layers)
    flags.add_argument("--new-tokens", type=int, default=new_tokens)
    flags.add_argument("--context", type=int, default=4096)
    return flags


def module_command(module: str) -> list[str]:
    """`python -m module` with this interpreter (run it with cwd=ROOT, where `bench` is importable)."""
    return [sys.executable, "-m", module]
