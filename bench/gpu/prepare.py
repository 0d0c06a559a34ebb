"""Prepare, on a machine that reaches the package registries, what `make gpu-check` needs on a GPU machine
that reaches nothing: wheels of corolla's dependencies for that machine's Python, and SmolLM2's tokenizer
(its chat template) for the random-weight checkpoints the check builds there. Everything lands in `.gpu/`
(git-ignored), which travels with the working tree.

The GPU machine brings its own CUDA torch and much besides: `bench/gpu/image.txt` lists what its image
holds (`python3 -m pip freeze` there; a name without a version is taken to satisfy any requirement). The
wheels fetched are the dependencies (corolla's, pytest-asyncio's and pytest-timeout's, as this machine's
environment resolves them) that the image lacks or holds at a version corolla does not accept, each at the
version corolla is tested with. CUDA builds of torch and its kernels are never fetched; bitsandbytes (only the
opt-in blockwise8 wire encoding needs it, ~70 MB) is left out unless named with `--with`.

    python -m bench.gpu.prepare [--python-version 3.12] [--image bench/gpu/image.txt] [--limit-mib 60]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

from bench.lib.stamp import report

GPU = Path(".gpu")
ROOTS = ("corolla", "pytest-asyncio", "pytest-timeout")
NEVER = ("torch", "triton")  # the GPU machine's own CUDA stack, with its nvidia-* and cuda-* packages
NEVER_PREFIXES = ("nvidia-", "cuda-")
OPTIONAL = ("bitsandbytes",)
# manylinux tags pip matches exactly: the ones x86-64 wheels are commonly built for
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31, 28, 27, 24, 17)]
PLATFORMS += ["manylinux2014_x86_64", "manylinux1_x86_64"]


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: tuple[str, ...]) -> dict[str, tuple[str, list[Requirement]]]:
    """Every distribution `roots` need here (markers evaluated without extras): name -> (the version
    installed here, the requirements on it)."""
    found: dict[str, tuple[str, list[Requirement]]] = {}
    wanted: list[Requirement] = [Requirement(root) for root in roots]
    while wanted:
        requirement = wanted.pop()
        name = normal(requirement.name)
        if name in found:
            found[name][1].append(requirement)
            continue
        dist = metadata.distribution(requirement.name)
        found[name] = (dist.version, [requirement])
        for line in dist.requires or []:
            needed = Requirement(line)
            if needed.marker is None or needed.marker.evaluate({"extra": ""}):
                wanted.append(needed)
    return found


def image_versions(path: Path) -> dict[str, str | None]:
    """The GPU image's packages: name -> version (None: unknown, taken to satisfy any requirement)."""
    held: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            held[normal(name)] = version.strip() or None
    return held


def satisfied(version: str | None, requirements: list[Requirement]) -> bool:
    if version is None:
        return True
    try:
        parsed = Version(version)
    except InvalidVersion:
        return False
    return all(parsed in r.specifier for r in requirements)


def to_fetch(image: dict[str, str | None], extra: list[str]) -> dict[str, str]:
    """name -> version: what the GPU machine lacks, at the version tested here."""
    fetch = {}
    for name, (version, requirements) in closure(ROOTS).items():
        never = name in NEVER or name.startswith(NEVER_PREFIXES)
        if name == "corolla" or never or (name in OPTIONAL and name not in extra):
            continue
        if name in image and satisfied(image[name], requirements):
            continue
        fetch[name] = version
    return fetch


def download(packages: dict[str, str], python_version: str, dest: Path) -> None:
    """Binary wheels for the GPU machine's Python; a package published only as source (pure Python:
    prefetch-generator, varint) is built into a wheel here, which must then fit any Python 3."""
    platforms = [flag for platform in PLATFORMS for flag in ("--platform", platform)]
    binary = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    binary += ["--python-version", python_version, "--implementation", "cp", *platforms, "-d", str(dest)]
    for name, version in sorted(packages.items()):
        spec = f"{name}=={version}"
        if subprocess.run([*binary, spec], capture_output=True).returncode == 0:
            continue
        built = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(dest), spec],
            capture_output=True,
            text=True,
        )
        wheels = list(dest.glob(f"{re.sub(r'[-.]', '_', name)}-{version}-*.whl"))
        if built.returncode != 0 or not all(w.name.endswith("-py3-none-any.whl") for w in wheels):
            sys.exit(f"{spec}: no wheel for Python {python_version} and none built here\n{built.stderr}")


def save_tokenizer(dest: Path) -> None:
    """SmolLM2's tokenizer files (its chat template included), for checkpoints of random weights."""
    from transformers import AutoTokenizer

    from corolla.models.source import resolve_model

    AutoTokenizer.from_pretrained(resolve_model("smollm2").path).save_pretrained(dest)


def main() -> None:
    flags = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    flags.add_argument("--image", type=Path, default=Path(__file__).with_name("image.txt"))
    flags.add_argument("--with", dest="extra", nargs="*", default=[], help="optional packages to fetch too")
    flags.add_argument("--limit-mib", type=float, default=60.0, help="what may travel with the tree")
    args = flags.parse_args()
    packages = to_fetch(image_versions(args.image), [normal(n) for n in args.extra])
    shutil.rmtree(GPU, ignore_errors=True)
    download(packages, args.python_version, GPU / "wheels")
    save_tokenizer(GPU / "tokenizer")
    sizes = {p.name: p.stat().st_size for p in sorted((GPU / "wheels").glob("*.whl"))}
    total = sum(f.stat().st_size for f in GPU.rglob("*") if f.is_file())
    result = {"python_version": args.python_version, "wheels": sizes, "total_mib": round(total / 2**20, 1)}
    report(__file__, result)
    if total > args.limit_mib * 2**20:
        sys.exit(f"{GPU}/ holds {total / 2**20:.1f} MiB, over the {args.limit_mib} MiB that may travel")


if __name__ == "__main__":
    main()
