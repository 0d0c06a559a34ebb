"""Reading typed fields out of an untrusted msgpack dictionary.

`Fields` wraps the decoded metadata of one message and hands out typed values; every accessor raises
`InvalidRequest` naming the field, the expected type and the bound it broke. Unknown keys are ignored
(forward compatibility), so a newer peer can add fields without breaking older ones.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack

from corolla.errors import InvalidRequest

MAX_METADATA_BYTES = 64 * 1024
MAX_ID_CHARS = 128


def unpack(raw: bytes, where: str) -> Fields:
    """Decode msgpack metadata into `Fields`; empty bytes give an empty dictionary."""
    if len(raw) > MAX_METADATA_BYTES:
        raise InvalidRequest(f"{where}: metadata is {len(raw)} bytes, the limit is {MAX_METADATA_BYTES}")
    if not raw:
        return Fields({}, where)
    try:
        data = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException, TypeError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"{where}: metadata is not valid msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise InvalidRequest(f"{where}: metadata must be a msgpack map, got {type(data).__name__}")
    return Fields(data, where)


def pack(data: dict[str, Any]) -> bytes:
    """Encode metadata, leaving out keys whose value is None."""
    return msgpack.packb({k: v for k, v in data.items() if v is not None}, use_bin_type=True)


class Fields:
    """Typed, validated access to one message's metadata."""

    def __init__(self, data: dict[Any, Any], where: str):
        self._data = data
        self.where = where

    def __contains__(self, name: str) -> bool:
        return self._data.get(name) is not None

    def error(self, name: str, problem: str) -> InvalidRequest:
        return InvalidRequest(f"{self.where}: field {name!r} {problem}")

    def int(
        self,
        name: str,
        *,
        default: int | None = None,
        low: int | None = None,
        high: int | None = None,
        required: bool = False,
    ) -> int | None:
        value = self._get(name, required)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(name, f"must be an integer, got {type(value).__name__} {value!r}")
        self._check_range(name, value, low, high)
        return value

    def float(
        self, name: str, *, default: float | None = None, low: float | None = None, high: float | None = None
    ) -> float | None:
        value = self._get(name, False)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.error(name, f"must be a finite number, got {value!r}")
        self._check_range(name, value, low, high)
        return float(value)

    def str(self, name: str, *, max_chars: int = MAX_ID_CHARS, required: bool = False) -> str | None:
        value = self._get(name, required)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self.error(name, f"must be a string, got {type(value).__name__}")
        if len(value) > max_chars:
            raise self.error(name, f"has {len(value)} characters, the limit is {max_chars}")
        return value

    def bool(self, name: str, *, default: bool = False) -> bool:
        value = self._get(name, False)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(name, f"must be a boolean, got {type(value).__name__}")
        return value

    def list(self, name: str, *, max_items: int) -> list[Any]:
        value = self._get(name, False)
        if value is None:
            return []
        if not isinstance(value, (list, tuple)):
            raise self.error(name, f"must be a list, got {type(value).__name__}")
        if len(value) > max_items:
            raise self.error(name, f"has {len(value)} items, the limit is {max_items}")
        return list(value)

    def map(self, name: str) -> dict[Any, Any]:
        value = self._get(name, False)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.error(name, f"must be a map, got {type(value).__name__}")
        return value

    def _get(self, name: str, required: bool) -> Any:
        value = self._data.get(name)
        if value is None and required:
            raise self.error(name, "is required")
        return value

    def _check_range(self, name: str, value: float, low: float | None, high: float | None) -> None:
        if low is not None and value < low:
            raise self.error(name, f"must be >= {low}, got {value}")
        if high is not None and value > high:
            raise self.error(name, f"must be <= {high}, got {value}")
