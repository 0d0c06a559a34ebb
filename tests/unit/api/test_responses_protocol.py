"""The Responses API's requests translated into the chat completions corolla serves
(api/responses_protocol.py), and the store that continues conversations (api/conversations.py)."""

from __future__ import annotations

import pytest

from corolla.api.conversations import Conversations, NotStored, owner_of
from corolla.api.responses_protocol import ResponsesRequest
from corolla.api.responses_tools import split_name
from corolla.errors import InvalidRequest

CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}


def TEXT(text: str) -> dict:
    return {"type": "input_text", "text": text}


TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


def request(**fields):
    return ResponsesRequest.model_validate({"input": "Hi", **fields})


def test_a_string_input_is_one_user_message_after_the_instructions():
    chat = request(instructions="Be terse.", max_output_tokens=7, temperature=0.5).to_openai([], "m")
    assert [m.role for m in chat.messages] == ["system", "user"]
    assert (chat.messages[1].text(), chat.token_limit, chat.temperature, chat.top_p) == ("Hi", 7, 0.5, 1.0)
    assert not chat.stream and request(stream=True).to_openai([], "m").include_usage


def test_calls_join_their_assistant_turn_and_outputs_become_tool_messages():
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, TEXT("Oslo?")]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
        CALL,
        {**CALL, "call_id": "call_2"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [TEXT("warm")]},
    ]  # fmt: skip
    chat = request(input=items, tools=[TOOL]).to_openai([], "m")
    user, assistant, first, second = chat.messages
    assert user.text() == "Weather in Oslo?" and assistant.text() == "Looking."
    assert [call.id for call in assistant.tool_calls] == ["call_1", "call_2"]
    assert (first.role, first.tool_call_id, first.text()) == ("tool", "call_1", "sunny")
    assert (second.tool_call_id, second.text()) == ("call_2", "warm")
    assert chat.tools[0].function.name == "get_weather"


def test_a_call_without_a_message_before_it_is_an_assistant_turn_of_its_own():
    chat = request(input=[{"role": "user", "content": "Hi"}, CALL], tools=[TOOL]).to_openai([], "m")
    assert chat.messages[1].role == "assistant" and chat.messages[1].content is None
    assert chat.messages[1].tool_calls[0].function.name == "get_weather"


def test_history_comes_before_the_new_input_and_formats_and_choices_translate():
    history = [{"type": "message", "role": "user", "content": "Earlier"}]
    schema = {"type": "json_schema", "name": "city", "schema": {"type": "object"}, "strict": True}
    chat = request(
        text={"format": schema}, tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"}
    ).to_openai(history, "m")
    assert [m.text() for m in chat.messages] == ["Earlier", "Hi"]
    assert chat.response_format.json_schema.name == "city"
    assert chat.tool_choice.function.name == "get_weather"
    assert (
        request(text={"format": {"type": "json_object"}}).to_openai([], "m").response_format.type
        == "json_object"
    )
    logprobs = request(include=["message.output_text.logprobs"], top_logprobs=3).to_openai([], "m")
    assert logprobs.logprobs and logprobs.top_logprobs == 3


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input[0].content[0]"),
        ({"input": [{"type": "web_search_call", "id": "ws"}]}, "input[0]"),
        ({"tools": [{"type": "file_search"}]}, "tools[0]"),
        ({"tools": [{"type": "function"}]}, "tools[0].name"),
        ({"tools": [{"type": "namespace", "name": "a.b", "tools": [TOOL]}]}, "tools[0].name"),
        ({"tools": [TOOL, {"type": "namespace", "name": "n", "tools": [{"type": "x"}]}]}, "tools[1].tools[0]"),  # noqa: E501
        ({"tools": [{"type": "namespace", "name": "n" * 60, "tools": [TOOL]}]}, "tools[0].tools[0].name"),
        ({"input": [{**CALL, "namespace": "n" * 60}]}, "input[0].name"),
        ({"tool_choice": {"type": "web_search_preview"}, "tools": [TOOL]}, "tool_choice"),
        ({"truncation": "auto"}, "truncation"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"reasoning": {"effort": "low"}}, "reasoning.effort"),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_refused_naming_the_field(fields, named):
    with pytest.raises(InvalidRequest, match=rf"^{named.replace('[', '.').replace(']', '.')}"):
        request(**fields).to_openai([], "m")


def test_a_namespace_s_functions_are_tools_named_with_it_and_its_calls_say_so():
    """Codex groups its sub-agent tools in a namespace: the model sees `namespace.function`, a call comes
    back as the function with its `namespace`, and a call item with a namespace goes back in qualified."""
    spawn = {"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}}
    group = {"type": "namespace", "name": "agents", "description": "sub-agents", "tools": [spawn]}
    call = {**CALL, "name": "spawn_agent", "namespace": "agents"}
    chat = request(
        tools=[TOOL, group],
        tool_choice={"type": "function", "name": "spawn_agent", "namespace": "agents"},
        input=[
            {"role": "user", "content": "Go."},
            call,
            {"type": "function_call_output", "call_id": "call_1", "output": "ok"},
        ],
    ).to_openai([], "m")
    assert [tool.function.name for tool in chat.tools] == ["get_weather", "agents.spawn_agent"]
    assert chat.tool_choice.function.name == "agents.spawn_agent"
    assert chat.messages[1].tool_calls[0].function.name == "agents.spawn_agent"
    assert split_name("agents.spawn_agent", frozenset({"agents"})) == ("agents", "spawn_agent")
    assert split_name("other.tool", frozenset({"agents"})) == (None, "other.tool")  # a dotted function's own


def test_reasoning_left_at_none_and_unused_settings_are_accepted():
    chat = request(reasoning={"effort": None}, include=["reasoning.encrypted_content"], metadata={"a": "b"})
    assert chat.to_openai([], "m").messages[0].text() == "Hi"


def stored(conversations: Conversations, owner: str, parent: str | None, text: str) -> str:
    response_id = f"resp_{len(conversations)}_{text}"
    items = [{"role": "user", "content": text}, {"type": "message", "role": "assistant", "content": text}]
    conversations.keep(owner, parent, items, {"id": response_id})
    return response_id


def test_a_conversation_is_the_chain_of_its_turns_and_only_its_owner_reads_it():
    conversations = Conversations()
    alice, bob = owner_of("alice"), owner_of("bob")
    first = stored(conversations, alice, None, "one")
    second = stored(conversations, alice, first, "two")
    assert [item["content"] for item in conversations.history(alice, second)] == ["one", "one", "two", "two"]
    assert conversations.history(alice, None) == []
    with pytest.raises(NotStored, match="previous_response_id"):
        conversations.history(bob, second)
    conversations.delete(alice, first)
    with pytest.raises(NotStored, match="earlier turn"):
        conversations.history(alice, second)


def test_the_least_recently_used_go_first_per_key_and_in_bytes():
    conversations = Conversations(per_key=2)
    alice, bob = owner_of("alice"), owner_of("bob")
    first = stored(conversations, alice, None, "a")
    second = stored(conversations, alice, None, "b")
    conversations.get(alice, first)  # used: the second is now the least recent
    stored(conversations, alice, None, "c")
    stored(conversations, bob, None, "d")  # another key's count is its own
    with pytest.raises(NotStored):
        conversations.get(alice, second)
    assert conversations.get(alice, first) and len(conversations) == 3

    small = Conversations(max_bytes=conversations.bytes // 3 * 2)
    for text in "xyz":
        stored(small, alice, None, text)
    assert len(small) == 2 and small.bytes <= small.max_bytes
