"""The Responses API's tools as chat completions take them: function tools as they are, and namespaces of
functions (as Codex CLI groups its sub-agent tools) flattened, each function named `namespace.function` for
the model; a call of such a name goes back to the client as the function with its `namespace`."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from corolla.api.chat_protocol import MAX_TOOLS, FunctionName
from corolla.api.protocol import OpenAIBaseModel
from corolla.errors import InvalidRequest


class ResponsesTool(OpenAIBaseModel):
    type: str
    name: FunctionName | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    tools: Annotated[list[ResponsesTool], Field(max_length=MAX_TOOLS)] | None = None  # a namespace's


def qualified(namespace: str | None, name: str, where: str) -> str:
    """A namespace's function as the model sees it: `namespace.name` (one name among the flat tools), at
    most 64 characters as every function name; InvalidRequest naming `where.name` if longer."""
    if not namespace:
        return name
    if len(namespace) + 1 + len(name) > 64:
        raise InvalidRequest(f"{where}.name: with its namespace, a name has at most 64 characters")
    return f"{namespace}.{name}"


def split_name(name: str, namespaces: frozenset[str]) -> tuple[str | None, str]:
    """The namespace and function of a called name (no namespace for a top-level function)."""
    namespace, dot, function = name.partition(".")
    return (namespace, function) if dot and namespace in namespaces else (None, name)


def namespaces_of(tools: list[ResponsesTool] | None) -> frozenset[str]:
    return frozenset(tool.name for tool in tools or [] if tool.type == "namespace" and tool.name)


def function_tools(tools: list[ResponsesTool]) -> list[dict[str, Any]]:
    """Chat's function tools: top-level functions as they are, a namespace's functions (as Codex groups
    its sub-agent tools) flattened under qualified names; anything else is refused naming it."""
    functions = []
    for i, tool in enumerate(tools):
        if tool.type != "namespace":
            functions.append(_function(f"tools[{i}]", tool))
            continue
        if tool.name is None or "." in tool.name:
            raise InvalidRequest(f"tools[{i}].name: a namespace needs a name without dots")
        for j, inner in enumerate(tool.tools or []):
            where = f"tools[{i}].tools[{j}]"
            function = _function(where, inner)["function"]
            function["name"] = qualified(tool.name, function["name"], where)
            described = (tool.description, function["description"])  # the namespace's is shown to the model
            function["description"] = " ".join(text for text in described if text) or None
            functions.append({"type": "function", "function": function})
    return functions


def _function(where: str, tool: ResponsesTool) -> dict[str, Any]:
    if tool.type != "function":
        raise InvalidRequest(f"{where}: built-in tools ({tool.type}) are not supported; define a function")
    if tool.name is None:
        raise InvalidRequest(f"{where}.name: a function tool needs a name")
    parameters = tool.parameters or {"type": "object", "properties": {}}
    function = {"name": tool.name, "description": tool.description, "parameters": parameters}
    return {"type": "function", "function": function}
