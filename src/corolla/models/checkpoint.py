"""Reading parts of a safetensors checkpoint (one file, or shards with an index).

A server reads only its blocks' tensors and a client only the embeddings, final norm and LM head:
safetensors files are memory-mapped and only the tensors asked for are read, so a process never holds
weights it does not run. `get_tensor` hands out tensors backed by the file's mapping, which stays while any
of them lives, with every page of the file that loading touched: a block's tensors are read `owned`, copied
into memory of their own, or a MoE block whose per-expert tensors are fused into new ones (and whose other
tensors are kept as stored) would hold its experts twice, mapped and fused. The head's stay mapped: an
embedding table's rows that no token looks up are never read.

Key prefixes differ between checkpoints (`model.layers.3.` in `LlamaForCausalLM`, `layers.3.` in a bare
`LlamaModel`), so the prefix is detected once from the keys.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from corolla.errors import UnsupportedModel

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class Checkpoint:
    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.weight_map = self._read_weight_map()  # tensor name -> file name
        self.prefix = self._detect_prefix()

    def _read_weight_map(self) -> dict[str, str]:
        index = self.folder / INDEX_FILE
        if index.is_file():
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise UnsupportedModel(f"{index} has no weight_map")
            return {str(k): str(v) for k, v in weight_map.items()}
        single = self.folder / SINGLE_FILE
        if single.is_file():
            with safe_open(single, framework="pt") as f:
                return dict.fromkeys(f.keys(), SINGLE_FILE)
        raise UnsupportedModel(
            f"{self.folder} has neither {SINGLE_FILE} nor {INDEX_FILE}; corolla reads safetensors "
            "checkpoints (convert .bin checkpoints with transformers' save_pretrained)"
        )

    def _detect_prefix(self) -> str:
        for name in self.weight_map:
            if name.endswith("embed_tokens.weight"):
                return name[: -len("embed_tokens.weight")]
        for name in self.weight_map:
            if ".layers.0." in name or name.startswith("layers.0."):
                return name[: name.index("layers.0.")]
        raise UnsupportedModel(f"{self.folder}: cannot find embed_tokens or layers.0 among the tensor names")

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def read(
        self, names: list[str], dtype: torch.dtype | None = None, owned: bool = False
    ) -> dict[str, torch.Tensor]:
        """Read the named tensors (full names), opening each shard once; in their stored dtype by default;
        `owned`: in memory of their own, not the file's mapping."""
        by_file: dict[str, list[str]] = defaultdict(list)
        for name in names:
            if name not in self.weight_map:
                raise UnsupportedModel(f"{self.folder}: tensor {name!r} is missing from the checkpoint")
            by_file[self.weight_map[name]].append(name)
        tensors = {}
        for file_name, file_names in by_file.items():
            with safe_open(self.folder / file_name, framework="pt") as f:
                for name in file_names:
                    tensor = f.get_tensor(name)
                    tensors[name] = tensor.to(dtype or tensor.dtype, copy=owned)
        return tensors

    def block_names(self, index: int) -> list[str]:
        """The full names of block `index`'s tensors."""
        block_prefix = f"{self.prefix}layers.{index}."
        names = [name for name in self.weight_map if name.startswith(block_prefix)]
        if not names:
            raise UnsupportedModel(f"{self.folder}: the checkpoint has no tensors for block {index}")
        return names

    def head_names(self) -> list[str]:
        """Every tensor outside the transformer blocks: embeddings, final norm, LM head (and a multimodal
        checkpoint's other towers, which the caller leaves out)."""
        return [name for name in self.weight_map if not name.startswith(f"{self.prefix}layers.")]
