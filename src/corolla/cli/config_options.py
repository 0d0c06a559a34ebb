"""Command-line options made from configuration fields (config.py): one option per field, its flag, dest,
type and default read from the dataclass, so each default is written once and `%(default)s` in a help
text shows the value a Python caller gets too. The configurations check the values (they raise what the
CLI prints); options that set no field (a positional MODEL, --allowed-peers' file) are added as usual.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import types
import typing
from typing import Any

SIMPLE_TYPES = {int: int, float: float, str: None}  # str: argparse's own (the text as it is)


def add_field(
    parser: argparse._ActionsContainer,
    config: type,
    name: str,
    help: str,
    *aliases: str,
    flag: str | None = None,
    **overrides: Any,
) -> argparse.Action:
    """Add the option that sets `config`'s field `name`: `--name-with-dashes` (or `flag`) and `aliases`,
    dest `name`, the field's default, and its annotation's type: int, float or str (X | None: the same),
    bool a --x/--no-x switch, tuple[X, ...] a repeatable option collected in a list. `overrides` (dest,
    type, metavar, choices, action, default...) go to add_argument as given, for a flag that needs them;
    a field of any other type needs its `type`."""
    options: dict[str, Any] = {"dest": name, "default": field_default(config, name), "help": help}
    options.update(_parsing(config, name, overrides))
    if options.get("action") == "append":  # argparse appends to a copy of the default: a list
        options["default"] = list(options["default"])
    options.update(overrides)
    return parser.add_argument(flag or "--" + name.replace("_", "-"), *aliases, **options)


def field_default(config: type, name: str) -> Any:
    """The value `config` gives its field `name` when the caller gives none."""
    spec = _fields(config)[name]
    if spec.default is not dataclasses.MISSING:
        return spec.default
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    raise TypeError(f"{config.__name__}.{name} has no default for its option to show")


def field_values(args: argparse.Namespace, config: type) -> dict[str, Any]:
    """The values in `args` of `config`'s fields (options whose dest is the field's name), repeated
    options' lists as tuples: the keyword arguments that build `config` from the command line. Only for a
    command where no other option's dest is one of those names (`corolla api`'s swarm `host` is not
    ApiConfig's)."""
    given = vars(args)
    return {
        name: tuple(given[name]) if isinstance(given[name], list) else given[name]
        for name in _fields(config)
        if name in given
    }


def _parsing(config: type, name: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """add_argument's `type` and `action` for the field's annotation (none of them where `overrides` set
    the action: store_true and store_const take no type)."""
    if "action" in overrides:
        return {}
    hint = _hints(config)[name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None: X, default None
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    if hint in SIMPLE_TYPES:
        return {"type": SIMPLE_TYPES[hint]}
    item, *rest = typing.get_args(hint) or (None,)
    if typing.get_origin(hint) is tuple and rest == [Ellipsis] and item in SIMPLE_TYPES:
        return {"action": "append", "type": SIMPLE_TYPES[item]}
    if "type" not in overrides:
        raise TypeError(f"{config.__name__}.{name} is a {hint}: its option needs a type= to parse it")
    return {}


@functools.cache
def _fields(config: type) -> dict[str, dataclasses.Field]:
    return {spec.name: spec for spec in dataclasses.fields(config)}


@functools.cache
def _hints(config: type) -> dict[str, Any]:
    return typing.get_type_hints(config)  # config.py's annotations are strings (`from __future__`)
