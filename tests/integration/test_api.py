"""`corolla api` on a local SmolLM2 swarm, driven by the official `openai` package and by raw HTTP.

Greedy answers must equal `DistributedModelForCausalLM.generate` token for token (compared as the text
and the token count), streaming or not; stop strings never show; bad requests get OpenAI-shaped 4xx
errors; a client that goes away leaves no session open on any server.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from openai import OpenAI

from corolla.swarm.p2p.ping import fetch_status
from swarm_helpers import wait_until

MODEL = "SmolLM2-135M-Instruct"
PARIS = [{"role": "user", "content": "What is the capital of France?"}]
POEM = [{"role": "user", "content": "Write a short poem about the sea."}]


def chat_ids(model, messages) -> list[int]:
    text = model.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return model.tokenizer(text, add_special_tokens=False).input_ids


def expected(model, input_ids: list[int], max_new_tokens: int) -> tuple[str, int, str]:
    """What the Python client generates greedily: (text, tokens generated, finish reason)."""
    out = model.generate(torch.tensor([input_ids]), max_new_tokens=max_new_tokens)[
        0, len(input_ids) :
    ].tolist()
    eos = [i for i, token in enumerate(out) if token in model.eos_token_ids]
    text_ids = out[: eos[0]] if eos else out
    text = model.tokenizer.decode(text_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return text, len(out), "stop" if eos else "length"


def post(url: str, body: bytes | dict) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


def stream_chat(client: OpenAI, messages, **kwargs) -> tuple[str, list]:
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


# --- exactness --------------------------------------------------------------------------------------------


def test_chat_equals_the_python_client(smol_openai, smol_client):
    text, num_tokens, reason = expected(smol_client, chat_ids(smol_client, POEM), 40)
    assert reason == "length" and num_tokens == 40
    answer = smol_openai.chat.completions.create(model=MODEL, messages=POEM, max_tokens=40, temperature=0)
    assert answer.choices[0].message.content == text
    assert answer.choices[0].finish_reason == "length"
    prompt_tokens = len(chat_ids(smol_client, POEM))
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (prompt_tokens, 40)
    assert answer.usage.total_tokens == prompt_tokens + 40

    streamed, chunks = stream_chat(
        smol_openai, POEM, max_tokens=40, temperature=0, stream_options={"include_usage": True}
    )
    assert streamed == text
    token_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content is not None][1:]
    assert len(token_chunks) == 40  # one chunk per token, after the opening chunk with the role
    assert chunks[0].choices[0].delta.role == "assistant"
    assert token_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 40 and not chunks[-1].choices


def test_an_answer_that_ends_with_eos_finishes_with_stop(smol_openai, smol_client):
    text, num_tokens, reason = expected(smol_client, chat_ids(smol_client, PARIS), 64)
    assert reason == "stop" and "Paris" in text
    answer = smol_openai.chat.completions.create(model=MODEL, messages=PARIS, temperature=0)
    assert answer.choices[0].message.content == text
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.completion_tokens == num_tokens  # the end-of-text token counts


def test_completions_equal_the_python_client(smol_openai, smol_client):
    prompt = "The three primary colors are"
    ids = smol_client.tokenizer(prompt).input_ids
    text, _, reason = expected(smol_client, ids, 20)
    answer = smol_openai.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    assert answer.choices[0].text == text and answer.choices[0].finish_reason == reason
    assert answer.usage.prompt_tokens == len(ids)
    chunks = list(
        smol_openai.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == reason


def test_stop_cuts_before_the_stop_string(smol_openai, smol_client):
    text, _, _ = expected(smol_client, chat_ids(smol_client, POEM), 40)
    words = re.findall(r"[A-Za-z]{4,}", text)
    stop = words[len(words) // 2]  # a word in the middle of the answer
    cut = text[: text.index(stop)]
    for stream in (False, True):
        if stream:
            answer, chunks = stream_chat(smol_openai, POEM, max_tokens=40, temperature=0, stop=[stop, "zzzz"])
            reason = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            response = smol_openai.chat.completions.create(
                model=MODEL, messages=POEM, max_tokens=40, temperature=0, stop=stop
            )
            answer, reason = response.choices[0].message.content, [response.choices[0].finish_reason]
        assert answer == cut and stop not in answer
        assert reason == ["stop"]


def test_n_with_a_seed_gives_reproducible_choices(smol_openai):
    def sample():
        answer = smol_openai.chat.completions.create(
            model=MODEL, messages=POEM, max_tokens=16, temperature=0.9, n=2, seed=1234
        )
        assert [c.index for c in answer.choices] == [0, 1]
        assert answer.usage.completion_tokens == sum(
            16 if c.finish_reason == "length" else 0 for c in answer.choices
        ) or all(c.finish_reason == "stop" for c in answer.choices)
        return [c.message.content for c in answer.choices]

    first = sample()
    assert first == sample()
    assert first[0] != first[1]  # two rows drawn from one seeded generator differ


def test_penalties_change_the_greedy_answer(smol_openai, smol_client):
    plain, _, _ = expected(smol_client, chat_ids(smol_client, POEM), 40)
    answer = smol_openai.chat.completions.create(
        model=MODEL, messages=POEM, max_tokens=40, temperature=0, frequency_penalty=2.0, presence_penalty=2.0
    )
    assert answer.choices[0].message.content != plain


def test_logprobs(smol_openai):
    answer = smol_openai.chat.completions.create(
        model=MODEL, messages=PARIS, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].token == entry.token  # greedy: the likeliest token was chosen
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    completion = smol_openai.completions.create(
        model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=2
    )
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4


# --- bad requests -----------------------------------------------------------------------------------------

BAD = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"messages": PARIS}, 400, "model"),
    ({"model": MODEL, "messages": PARIS, "temperature": 3}, 400, "temperature"),
    ({"model": MODEL, "messages": PARIS, "temperature": "warm"}, 400, "temperature"),
    ({"model": "gpt-7", "messages": PARIS}, 404, "model"),
    ({"model": MODEL, "messages": PARIS, "max_tokens": 5000}, 400, "max_tokens"),
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ({"model": MODEL, "messages": "hello"}, 400, "messages"),
    ({"model": MODEL, "messages": PARIS, "n": 100}, 400, "n"),
    ({"model": MODEL, "messages": PARIS, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"model": MODEL, "messages": PARIS, "top_logprobs": 2}, 400, None),
    ({"model": MODEL, "messages": PARIS, "max_tokens": -1}, 400, "max_tokens"),
    ({"model": MODEL, "messages": PARIS, "logit_bias": {"99999999": 5}}, 400, None),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_chat_requests_get_openai_errors(smol_api, body, status, param):
    code, answer = post(f"{smol_api.url}/v1/chat/completions", body)
    assert code == status
    assert set(answer) == {"error"} and answer["error"]["message"] and answer["error"]["type"]
    if param is not None:
        assert answer["error"]["param"] == param


def test_errors_name_the_field_not_the_validator_and_unknown_routes_answer_openai_errors(smol_api):
    bad_part = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text"}]}]}
    code, answer = post(f"{smol_api.url}/v1/chat/completions", bad_part)
    assert code == 400 and answer["error"]["param"] == "messages.0.content"
    assert "messages.0.content.0.text: Field required" in answer["error"]["message"]
    assert not any(
        internal in answer["error"]["message"] for internal in ("function-after", "TextPart", "list[")
    )
    for method, route, status in [("GET", "/v1/nope", 404), ("POST", "/v1/models", 405)]:
        request = urllib.request.Request(
            f"{smol_api.url}{route}", method=method, data=b"{}" if method == "POST" else None
        )
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=30)
        assert info.value.code == status
        error = json.loads(info.value.read())["error"]
        assert route in error["message"] and error["type"] == "invalid_request_error"


def test_bad_completion_requests_and_the_server_keeps_serving(smol_api, smol_openai):
    for body, param in [
        ({"model": MODEL}, "prompt"),
        ({"model": MODEL, "prompt": "x", "echo": True}, None),
        ({"model": MODEL, "prompt": [10**9]}, "prompt"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 2000}, "max_tokens"),
    ]:
        code, answer = post(f"{smol_api.url}/v1/completions", body)
        assert code == 400 and answer["error"]["type"] == "invalid_request_error"
        if param:
            assert answer["error"]["param"] == param
    answer = smol_openai.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=4, temperature=0)
    assert answer.choices[0].message.content


# --- concurrency, disconnects, visibility -----------------------------------------------------------------


def test_sixteen_concurrent_streams_are_all_correct(smol_openai, smol_client):
    topics = ["cats", "rain", "bread", "the moon", "music", "rivers", "trains", "winter",
              "apples", "books", "clocks", "stars", "gardens", "bees", "mountains", "the wind"]  # fmt: skip
    prompts = [[{"role": "user", "content": f"Tell me one fact about {t}."}] for t in topics]
    with ThreadPoolExecutor(len(prompts)) as pool:  # the Python client's answers, batched as well
        wanted = [
            text
            for text, *_ in pool.map(lambda p: expected(smol_client, chat_ids(smol_client, p), 16), prompts)
        ]
    results: dict[int, str] = {}

    def run(i: int) -> None:
        results[i] = stream_chat(smol_openai, prompts[i], max_tokens=16, temperature=0)[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert [results.get(i) for i in range(len(prompts))] == wanted


def test_a_client_that_disconnects_leaves_no_session_open(smol_api, smol_openai, smol_client, smol_swarm):
    stream = smol_openai.chat.completions.create(
        model=MODEL,
        messages=POEM,
        max_tokens=500,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    tokens = 0
    for chunk in stream:
        tokens += bool(chunk.choices and chunk.choices[0].delta.content)
        if tokens == 5:
            break
    model = smol_client

    async def sessions_open() -> int:
        return sum(
            [
                (await fetch_status(model.client.swarm.peers.transport, s.peer_id, 10.0)).num_sessions
                for s in smol_swarm.servers
            ]
        )

    async def busy() -> bool:
        return await sessions_open() > 0

    assert model.runtime.run(busy())  # the generation is running on the servers
    stream.close()
    started = time.monotonic()
    assert model.runtime.run(wait_until(lambda: _none(sessions_open), timeout=10))
    closed_after = time.monotonic() - started
    metrics = get(f"{smol_api.url}/metrics")
    assert re.search(r"^corolla_api_aborted_requests_total 1\.0$", metrics, re.M), metrics
    assert re.search(r"^corolla_api_active_requests 0\.0$", metrics, re.M)
    assert closed_after < 10


def test_a_later_turn_of_a_chat_reuses_what_the_servers_hold(smol_api, smol_openai, smol_client, smol_swarm):
    """Turn 2 of a chat resends turn 1 (the API is stateless): the servers fork the session that ran turn 1
    instead of computing it again; the answer is the one a plain prefill gives (the Python client's, which
    has never seen this chat), and the cached tokens reported are those the servers forked. The system
    prompt is long (~700 tokens), as agents' are: forking then pays even where the holding chain's step
    times are measured a few times slower than another chain's (on a loaded machine; a short prefix is
    rightly prefilled elsewhere then: client/generation/prefix_cost.py)."""
    rules = " ".join(f"Rule {i}: answer in one short sentence, politely." for i in range(1, 61))
    messages = [
        {"role": "system", "content": f"You are a helpful assistant. {rules}"},
        {"role": "user", "content": "Name a colour of the rainbow."},
    ]
    first = smol_openai.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And another one?"},
    ]
    text, count, _ = expected(smol_client, chat_ids(smol_client, messages), 12)
    transport = smol_client.client.swarm.peers.transport

    async def forked() -> int:
        statuses = [await fetch_status(transport, s.peer_id, 10.0) for s in smol_swarm.servers]
        return sum(status.forked_tokens for status in statuses)

    before = smol_client.runtime.run(forked())
    second = smol_openai.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert (second.choices[0].message.content, second.usage.completion_tokens) == (text, count)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert (
        cached >= first.usage.prompt_tokens
    )  # turn 1's prompt at least, and the answer if retokenized alike
    grown = smol_client.runtime.run(forked()) - before
    assert grown > 0 and grown % cached == 0  # every server of the chain forked the same positions
    metrics = get(f"{smol_api.url}/metrics")
    counted = re.search(r"^corolla_api_cached_prompt_tokens_total (\S+)$", metrics, re.M)
    assert counted and float(counted.group(1)) >= cached
    rate = re.search(r"^corolla_api_prefix_hit_rate (\S+)$", metrics, re.M)
    assert rate and 0 < float(rate.group(1)) <= 1


async def _none(count) -> bool:
    return await count() == 0


def test_health_metrics_and_models(smol_api, smol_openai):
    assert json.loads(get(f"{smol_api.url}/health"))["status"] == "ok"
    assert [m.id for m in smol_openai.models.list().data] == [MODEL]
    metrics = get(f"{smol_api.url}/metrics")
    for name in (
        'corolla_api_requests_total{endpoint="chat",status="200"}',
        "corolla_api_generated_tokens_total",
        "corolla_api_time_to_first_token_seconds_count",
        "corolla_api_time_per_output_token_seconds_bucket",
        'corolla_api_errors_total{kind="invalid_request_error"}',
        'corolla_api_spot_checks{result="failed"} 0.0',  # spot checks are off here: nothing checked
        "corolla_api_faulty_servers 0.0",
        "corolla_api_refused_records 0.0",
    ):
        assert name in metrics
    assert float(re.search(r"^corolla_api_generated_tokens_total (\S+)$", metrics, re.M).group(1)) > 100


def test_an_api_with_keys_refuses_requests_without_one(smol_swarm):
    """`corolla api --api-key`: the official client without the key gets a 401 (AuthenticationError),
    with it an answer; browsers on an --allowed-origins origin may call it."""
    keyed = smol_swarm.add_api(extra_args=["--api-key", "sesame", "--allowed-origins", "https://app.example"])
    try:
        chat = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        with pytest.raises(openai.AuthenticationError, match="wrong API key") as refused:
            OpenAI(base_url=f"{keyed.url}/v1", api_key="wrong").chat.completions.create(**chat)
        assert refused.value.code == "invalid_api_key"
        answer = OpenAI(base_url=f"{keyed.url}/v1", api_key="sesame").chat.completions.create(**chat)
        assert answer.choices[0].message.content is not None
        request = urllib.request.Request(f"{keyed.url}/health", headers={"Origin": "https://app.example"})
        with urllib.request.urlopen(request, timeout=10) as reply:
            assert reply.headers["Access-Control-Allow-Origin"] == "https://app.example"
            assert reply.headers["X-Request-Id"]
    finally:
        keyed.stop()
        smol_swarm.apis.remove(keyed)
