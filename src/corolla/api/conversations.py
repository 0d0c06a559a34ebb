"""The responses `corolla api` keeps for the Responses API's `previous_response_id`: each stored response
holds its turn's items (the input it was sent and the output it gave) and the id of the response it
continued, so a conversation is the chain of its turns and a turn sends only what is new.

Responses belong to the API key that created them (a hash of it; no key: the anonymous owner) and are
never found with another. The store is bounded two ways, evicting the least recently used first: at
most `per_key` responses per key, and at most `max_bytes` of items and responses in all. Reading a
conversation touches every turn in it, so a conversation in use keeps its earlier turns. `store: false`
keeps nothing.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from corolla.errors import InvalidRequest

PER_KEY = 1000
MAX_BYTES = 256 << 20


class NotStored(InvalidRequest):
    """A response id this key has no stored response under (never stored, evicted, or another key's)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field  # the request's parameter that named it


@dataclass
class Stored:
    owner: str
    parent: str | None  # the response this one continued
    items: list[dict[str, Any]]  # the turn's input items, then its output items
    response: dict[str, Any]
    size: int  # bytes, as JSON


def owner_of(key: str | None) -> str:
    """Who owns what a request stores: a hash of its API key (the key itself is never kept)."""
    return hashlib.sha256((key or "").encode()).hexdigest()


class Conversations:
    def __init__(self, per_key: int = PER_KEY, max_bytes: int = MAX_BYTES):
        self.per_key = per_key
        self.max_bytes = max_bytes
        self.order: OrderedDict[str, str] = OrderedDict()  # response id -> owner, least recent first
        self.owners: dict[str, OrderedDict[str, Stored]] = {}
        self.bytes = 0

    def __len__(self) -> int:
        return len(self.order)

    def keep(self, owner: str, parent: str | None, items: list[dict[str, Any]], response: dict) -> None:
        size = len(json.dumps(items)) + len(json.dumps(response))
        if size > self.max_bytes:
            return  # larger than the whole store: kept by nobody
        stored = Stored(owner, parent, items, response, size)
        self.owners.setdefault(owner, OrderedDict())[response["id"]] = stored
        self.order[response["id"]] = owner
        self.bytes += size
        while len(self.owners[owner]) > self.per_key:
            self._drop(next(iter(self.owners[owner])))
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self.order)))

    def get(self, owner: str, response_id: str, field: str = "response_id") -> Stored:
        stored = self.owners.get(owner, {}).get(response_id)
        if stored is None:
            raise NotStored(f"{field}: no response with id {response_id!r} is stored", field)
        self.order.move_to_end(response_id)
        self.owners[owner].move_to_end(response_id)
        return stored

    def history(self, owner: str, response_id: str | None) -> list[dict[str, Any]]:
        """The items of a conversation up to and including `response_id`'s turn, oldest first."""
        turns: list[Stored] = []
        while response_id is not None:
            try:
                stored = self.get(owner, response_id, "previous_response_id")
            except NotStored:
                if not turns:
                    raise
                raise NotStored(
                    f"previous_response_id: an earlier turn of this conversation ({response_id!r}) is no "
                    "longer stored (the least recently used are evicted); send the whole conversation as "
                    "input",
                    "previous_response_id",
                ) from None
            turns.append(stored)
            response_id = stored.parent
        return [item for stored in reversed(turns) for item in stored.items]

    def delete(self, owner: str, response_id: str) -> None:
        self.get(owner, response_id)
        self._drop(response_id)

    def _drop(self, response_id: str) -> None:
        owner = self.order.pop(response_id)
        stored = self.owners[owner].pop(response_id)
        if not self.owners[owner]:
            del self.owners[owner]
        self.bytes -= stored.size
