"""JSON schemas made finite before they become grammars, so that a valid answer fits its token budget.

A schema that leaves things open lets a model write until it is cut off: extra keys (vLLM forbids them
unless a schema allows them; so do we), endless strings, arrays and digits. Where the schema says
nothing, this adds the bounds llguidance enforces: `additionalProperties: false` on objects that list
their properties, `maxLength` on free strings, `maxItems` on arrays, a magnitude on integers. String and
array bounds shrink with the budget (the request's max_tokens): the open strings share it, so an answer
that uses every bound still ends within it (each token writes one character at least; characters that
take several tokens, escapes or non-ASCII letters in a byte-level vocabulary, may still overrun it). What a
schema bounds itself is kept as written, and a bound added never falls below the schema's own minLength
or minItems (an answer must stay possible, even if it then needs more than the budget).
"""

from __future__ import annotations

import copy
from typing import Any

MAX_STRING = 256  # characters of a free string when no budget is given (or the budget allows more)
MIN_STRING = 8
MAX_ITEMS = 32
INTEGER_BOUND = 10**15 - 1  # 16 characters at most, signed
SUBSCHEMAS = ("items", "additionalItems", "contains", "not", "if", "then", "else")
SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
OVERHEAD = 8  # tokens of the answer that are not inside open strings and arrays, per open one


def bounded_schema(schema: dict[str, Any], max_tokens: int | None = None) -> dict[str, Any]:
    """A copy of `schema` with the bounds it leaves open filled in (see the module's docstring)."""
    schema = copy.deepcopy(schema)
    open_ones = _count_open(schema)
    share = MAX_STRING if max_tokens is None or not open_ones else max_tokens // open_ones - OVERHEAD
    _fill(schema, max(MIN_STRING, min(MAX_STRING, share)))
    return schema


def _children(schema: dict[str, Any]) -> list[Any]:
    found = [schema[key] for key in SUBSCHEMAS if key in schema]
    found += [
        item for key in SCHEMA_LISTS for item in schema.get(key) or () if isinstance(schema.get(key), list)
    ]
    found += [
        value for key in SCHEMA_MAPS if isinstance(schema.get(key), dict) for value in schema[key].values()
    ]
    if isinstance(schema.get("additionalProperties"), dict):
        found.append(schema["additionalProperties"])
    return [child for child in found if isinstance(child, dict)]


def _types(schema: dict[str, Any]) -> set[str]:
    kind = schema.get("type")
    return {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()


def _free_string(schema: dict[str, Any]) -> bool:
    given = ("maxLength", "enum", "const", "pattern", "format")
    return "string" in _types(schema) and not any(key in schema for key in given)


def _least(schema: dict[str, Any], key: str) -> int:
    """The schema's own lower bound `key` (minLength, minItems), 0 when it has none (or a malformed one:
    the grammar library then names it)."""
    value = schema.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _count_open(schema: dict[str, Any]) -> int:
    here = _free_string(schema) + ("array" in _types(schema) and "maxItems" not in schema)
    return here + sum(_count_open(child) for child in _children(schema))


def _fill(schema: dict[str, Any], length: int, close: bool = True) -> None:
    """`close`: False in allOf's branches, whose properties add up (each forbidding the others' keys would
    leave no valid object)."""
    types = _types(schema)
    keep_open = {"additionalProperties", "patternProperties", "unevaluatedProperties", "allOf"}
    if close and "properties" in schema and not keep_open & schema.keys():
        schema["additionalProperties"] = False
    if _free_string(schema):  # never below what the schema demands: a bound must leave an answer
        schema["maxLength"] = max(length, _least(schema, "minLength"))
    if "array" in types and "maxItems" not in schema:
        schema["maxItems"] = max(1, min(MAX_ITEMS, length // 8), _least(schema, "minItems"))
    if (
        "integer" in types
        and not {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"} & schema.keys()
    ):
        schema["minimum"] = -INTEGER_BOUND
        schema["maximum"] = INTEGER_BOUND
    branches = [id(branch) for branch in schema.get("allOf") or () if isinstance(schema.get("allOf"), list)]
    for child in _children(schema):
        _fill(child, length, close=id(child) not in branches)
