"""Tool calling's pure parts: which templates render tools, calls parsed from whole and streamed text,
and the grammar that makes any model's output a call to the named function."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from byte_tokenizer import EOS, byte_tokenizer
from corolla.api import tool_calls, tools
from corolla.api.chat_protocol import ChatCompletionRequest
from corolla.decoding.chooser import Chooser, RowEnds
from corolla.decoding.sampling import SamplingParams
from corolla.errors import InvalidRequest
from tool_model import TOOL_TEMPLATE

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": NO_ARGUMENTS}}


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER, TIME], **fields}
    )


def test_templates_that_read_tools_are_told_apart():
    assert tools.supports_tools(TOOL_TEMPLATE)
    assert tools.supports_tools({"default": "{{ messages }}", "tool_use": TOOL_TEMPLATE})
    assert not tools.supports_tools("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not tools.supports_tools("{{ broken")


def test_whole_answers_split_into_content_and_calls():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = tool_calls.parse(text)
    assert content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    assert calls[0].id.startswith("call_")
    assert tool_calls.parse("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert tool_calls.parse("plain") == ("plain", [])


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_streamed_text_gives_the_same_calls_and_holds_back_partial_markers(size):
    text = (
        'Hi <tool<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>'
    )
    stream, content, calls = tool_calls.CallStream(), "", []
    for start in range(0, len(text), size):
        piece, new = stream.feed(text[start : start + size])
        assert "<tool_c" not in piece  # never a piece of a marker
        content, calls = content + piece, calls + new
    content += stream.finish()[0]
    assert content == "Hi <tool" and [c.function.name for c in calls] == ["a", "b"]
    assert json.loads(calls[1].function.arguments) == {"x": 1}


def test_an_unfinished_call_is_not_content_whole_or_streamed():
    text = 'Sure.<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b"'
    content, calls = tool_calls.parse(text)
    assert content == "Sure." and [c.function.name for c in calls] == ["a"]
    assert tool_calls.parse('<tool_call>{"name": "a"') == (None, [])
    stream = tool_calls.CallStream()
    piece, new = stream.feed(text)
    assert piece == "Sure." and [c.function.name for c in new] == ["a"]
    assert stream.finish() == ("", [])  # the unfinished call "b" is dropped
    held = tool_calls.CallStream()
    assert held.feed("x <tool") == ("x ", []) and held.finish() == ("<tool", [])  # a prefix is text


def test_tool_choice_rules_name_the_field():
    with pytest.raises(ValueError, match="not in tools"):
        request(tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ValueError, match="tool_choice needs tools"):
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}
        )
    with pytest.raises(ValueError, match="unique"):
        request(tools=[WEATHER, WEATHER])
    assert tools.call_grammar(request(), None) is None  # auto: the model is free
    assert tools.call_grammar(request(tool_choice="none"), {"type": "object"}) is None


def decode(grammar: str, seed: int, steps: int = 200) -> str:
    """What a model with random logits writes under `grammar`."""
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer(), eos_token="<eos>")
    params = SamplingParams(max_new_tokens=steps, grammar=grammar, do_sample=True, seed=seed)
    chooser = Chooser(params, RowEnds(params, [EOS], tokenizer, 1), EOS, torch.zeros(1, 1).long())
    logits = torch.Generator().manual_seed(seed)
    while not chooser.done:
        chooser.choose(torch.randn(1, 300, generator=logits) * 3)
    assert bool(chooser.ends.finished[0]), "the grammar never let the output end"
    return tokenizer.decode([t for t in chooser.context[0, 1:].tolist() if t != EOS])


def test_a_named_tool_choice_forces_valid_calls_to_that_function():
    named = {"type": "function", "function": {"name": "get_weather"}}
    single = tools.call_grammar(request(tool_choice=named, parallel_tool_calls=False), None)
    parallel = tools.call_grammar(request(tool_choice=named), None)
    for seed in range(3):
        content, calls = tool_calls.parse(decode(single, seed))
        assert content is None and len(calls) == 1 and calls[0].function.name == "get_weather"
        assert len(json.loads(calls[0].function.arguments)["city"]) <= 8
        content, calls = tool_calls.parse(decode(parallel, seed, steps=400))
        assert content is None and calls and {c.function.name for c in calls} == {"get_weather"}


def test_required_lets_the_model_pick_among_the_tools_and_auto_with_a_format_allows_an_answer():
    grammar = tools.call_grammar(request(tool_choice="required", parallel_tool_calls=False), None)
    names = {call.function.name for seed in range(6) for call in tool_calls.parse(decode(grammar, seed))[1]}
    assert names <= {"get_weather", "get_time"} and names
    answer = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}}, "required": ["n"]}
    answer["additionalProperties"] = False
    either = tools.call_grammar(request(), answer)
    for seed in range(4):
        content, calls = tool_calls.parse(decode(either, seed))
        assert calls or set(json.loads(content)) == {"n"}


LLAMA_TEMPLATE = (  # what Llama 3.1-3.3 templates say about tools, in short
    '{{ tools }}Respond with {"name": function name, "parameters": dictionary of argument name and its '
    "value}.<|eot_id|>{{ messages }}"
)


def test_the_template_tells_the_call_format():
    assert tools.call_format(TOOL_TEMPLATE) is tool_calls.HERMES
    assert tools.call_format(LLAMA_TEMPLATE) is tool_calls.LLAMA3_JSON
    assert tools.call_format("{{ tools }}{{ messages }}") is tool_calls.HERMES  # the commonest, by default


def test_llama3_calls_are_the_whole_answer_in_bare_json():
    fmt = tool_calls.LLAMA3_JSON
    content, calls = tool_calls.parse(' {"name": "get_weather", "parameters": {"city": "Oslo"}}', fmt)
    assert content is None and json.loads(calls[0].function.arguments) == {"city": "Oslo"}
    assert tool_calls.parse('{"city": "Oslo"}', fmt) == ('{"city": "Oslo"}', [])  # JSON, not a call
    assert tool_calls.parse("It is sunny.", fmt) == ("It is sunny.", [])
    stream = tool_calls.CallStream(fmt)
    assert stream.feed(" ") == ("", []) and stream.feed('{"name": "f", ') == ("", [])  # held: may be a call
    assert stream.feed('"parameters": {}}') == ("", [])
    rest, (call,) = stream.finish()
    assert rest == "" and call.function.name == "f" and stream.count == 1
    text = tool_calls.CallStream(fmt)
    assert text.feed(" Hi") == (" Hi", []) and text.feed(" {there}") == (" {there}", [])
    assert text.finish() == ("", [])


def test_llama3_grammar_forces_one_bare_call_with_parameters():
    grammar = tools.call_grammar(request(tool_choice="required"), None, None, tool_calls.LLAMA3_JSON)
    for seed in range(3):
        content, (call,) = tool_calls.parse(decode(grammar, seed), tool_calls.LLAMA3_JSON)
        assert content is None and call.function.name in {"get_weather", "get_time"}


def test_the_bundled_chatml_tools_template_renders_tools_calls_and_results(smollm2_path):
    """`--chat-template chatml-tools` on SmolLM2 (whose own template renders no tools): the functions after
    the first system message, a call in Hermes' markers (which api/tool_calls.py reads back), results as
    <tool_response>s, later system messages in place; a missing file or a broken template is refused."""
    from transformers import AutoTokenizer

    from corolla.api.chat import chat_template
    from corolla.api.tools import call_format, supports_tools

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    assert not supports_tools(tokenizer.chat_template)
    tokenizer.chat_template = chat_template("chatml-tools")
    assert supports_tools(tokenizer.chat_template) and call_format(tokenizer.chat_template).name == "hermes"
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "system", "content": "It is Monday."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    text = tokenizer.apply_chat_template(messages, tools=[tool], tokenize=False, add_generation_prompt=True)
    system, user, later, assistant, result, prompt = text.split("<|im_start|>")[1:]
    assert system.startswith("system\nBe brief.") and '"name": "get_weather"' in system
    assert (user, later) == ("user\nWeather?<|im_end|>\n", "system\nIt is Monday.<|im_end|>\n")
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in assistant
    assert result == "user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" and prompt == "assistant\n"
    with pytest.raises(InvalidRequest, match=r"^chat_template \(--chat-template\): No such file"):
        chat_template("missing.jinja")
