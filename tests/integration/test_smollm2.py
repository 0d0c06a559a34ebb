"""SmolLM2-135M-Instruct through real servers: exact greedy chat, sampling, sessions, stop strings."""

from __future__ import annotations

import pytest
import torch

from swarm_helpers import SMOL_CHAINS, assert_boundaries_match, connect, reference_generate, run_corolla

CHAT = [{"role": "user", "content": "Write a short poem about the sea."}]


@pytest.fixture(scope="module")
def chat_ids(smol_client) -> torch.Tensor:
    text = smol_client.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    return smol_client.tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def expected_chat(smol_reference, chat_ids) -> torch.Tensor:
    return reference_generate(smol_reference, chat_ids, max_new_tokens=40)


@pytest.mark.parametrize("num_servers", [1, 2, 3])
def test_greedy_chat_matches_transformers(
    smollm2_path, smol_swarm, smol_reference, chat_ids, expected_chat, num_servers
):
    assert expected_chat.shape[1] - chat_ids.shape[1] == 40  # the answer is long: no early EOS
    with connect(smollm2_path, smol_swarm, SMOL_CHAINS[num_servers]) as model:
        assert torch.equal(model.generate(chat_ids, max_new_tokens=40), expected_chat)

        with torch.no_grad():
            hidden_states = smol_reference(chat_ids, output_hidden_states=True).hidden_states
        with model.inference_session(max_length=64) as session:
            outputs = session.step(model.head.embed(chat_ids))
            assert len(session.route) == num_servers
            assert_boundaries_match(model, session, outputs, hidden_states)


def test_seeded_sampling_is_reproducible(smol_client, chat_ids):
    params = dict(
        max_new_tokens=24,
        do_sample=True,
        temperature=0.9,
        top_k=50,
        top_p=0.95,
        repetition_penalty=1.1,
        ignore_eos=True,
    )
    first = smol_client.generate(chat_ids, seed=1234, **params)
    again = smol_client.generate(chat_ids, seed=1234, **params)
    other = smol_client.generate(chat_ids, seed=4321, **params)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_multi_turn_session_reuses_server_caches(smol_client):
    tokenizer = smol_client.tokenizer
    turn1 = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    turn1_ids = tokenizer(turn1, return_tensors="pt", add_special_tokens=False).input_ids
    turn2_ids = tokenizer(
        "\n<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n",
        return_tensors="pt",
        add_special_tokens=False,
    ).input_ids
    with smol_client.inference_session(max_length=200) as session:
        answer1 = smol_client.generate(turn1_ids, session=session, max_new_tokens=30)[:, turn1_ids.shape[1] :]
        position_after_turn1 = session.position
        answer2 = smol_client.generate(turn2_ids, session=session, max_new_tokens=30)[:, turn2_ids.shape[1] :]
    assert "Paris" in tokenizer.decode(answer1[0])
    assert session.position > position_after_turn1 > turn1_ids.shape[1]
    # the same conversation from scratch, without a session, continues identically
    history = torch.cat([turn1_ids, answer1, turn2_ids], dim=1)
    fresh = smol_client.generate(history, max_new_tokens=30)[:, history.shape[1] :]
    assert torch.equal(fresh, answer2)
    assert "Rome" in tokenizer.decode(answer2[0])


def test_stop_strings_and_streaming(smol_client):
    tokenizer = smol_client.tokenizer
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tokenizer(text, add_special_tokens=False).input_ids
    streamed = []
    output = smol_client.generate(ids, max_new_tokens=30, stop=("Paris",), streamer=streamed.append)
    new = output[0, len(ids) :]
    assert tokenizer.decode(new).endswith("Paris")  # stopped right at the stop string
    assert torch.equal(torch.cat(streamed), new)
    assert len(new) < 10


def test_generate_command_prints_the_answer(smol_swarm):
    args = [
        "generate",
        "smollm2",
        "What is the capital of France?",
        "--initial-peers",
        *smol_swarm.initial_peers,
    ]
    (result,) = run_corolla([*args, "--max-new-tokens", "20", "--no-nat-port-map"], timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "The capital of France is Paris." in result.stdout


def test_transformers_calls_through_real_servers(smol_client, smol_reference):
    """The issue 27 reproductions over real servers and sockets: a tokenizer's padded batch (each prompt
    gets what it gets alone: ' Paris.'), beam search and scores, against transformers on SmolLM2."""
    tokenizer = smol_client.tokenizer
    prompts = ["The capital of France is", "Three colours of the rainbow are"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    outputs = smol_client.generate(**batch, max_new_tokens=6)
    for row, prompt in enumerate(prompts):
        alone = tokenizer(prompt, return_tensors="pt")
        expected = reference_generate(smol_reference, alone.input_ids, max_new_tokens=6)
        new = expected[0, alone.input_ids.shape[1] :]
        assert torch.equal(outputs[row, batch.input_ids.shape[1] :][: len(new)], new), prompt
    alone = tokenizer(prompts[0], return_tensors="pt")
    with torch.no_grad():
        beams = smol_reference.generate(**alone, max_new_tokens=8, num_beams=3, num_return_sequences=2)
    assert torch.equal(
        smol_client.generate(**alone, max_new_tokens=8, num_beams=3, num_return_sequences=2), beams
    )
    asked = {"max_new_tokens": 6, "return_dict_in_generate": True, "output_scores": True}
    with torch.no_grad():
        theirs = smol_reference.generate(**alone, **asked, do_sample=False)
    ours = smol_client.generate(**alone, **asked)
    assert torch.equal(ours.sequences, theirs.sequences)
    for mine, expected in zip(ours.scores, theirs.scores, strict=True):  # over the network, in float32
        torch.testing.assert_close(mine, expected, rtol=1e-3, atol=1e-3)
