"""The client as transformers code sees it, on SmolLM2 over corolla's servers in this process
(tests/loopback.py): the same calls on the same checkpoint give the same tokens as local transformers,
through `pipeline`, a tokenizer's padded batch and `TextStreamer`; and the attributes such code reads."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, PretrainedConfig, TextStreamer, pipeline

from corolla import AutoDistributedModelForCausalLM, DistributedModelForCausalLM
from loopback import LoopbackSwarm
from tiny_models import load_reference

PROMPTS = ["The capital of France is", "Write a haiku about the sea.\n", "1, 2, 3,"]


@pytest.fixture(scope="module")
def smol(smollm2_path):
    with LoopbackSwarm(smollm2_path, [(0, 15), (15, 30)]) as swarm:
        yield swarm.model()


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="module")
def local(smollm2_path):
    return load_reference(smollm2_path)


def test_a_text_generation_pipeline_answers_as_on_local_transformers(smol, local, tokenizer):
    chat = [{"role": "user", "content": "What is 2+2?"}]
    for inputs in (PROMPTS[0], chat):
        ours = pipeline("text-generation", model=smol, tokenizer=tokenizer)(
            inputs, max_new_tokens=8, do_sample=False
        )
        theirs = pipeline("text-generation", model=local, tokenizer=tokenizer)(
            inputs, max_new_tokens=8, do_sample=False
        )
        assert ours == theirs


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_tokenizers_padded_batch_gives_each_prompt_its_own_answer(smol, local, tokenizer, side):
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True, padding_side=side)
    outputs = smol.generate(**batch, max_new_tokens=6)
    width = batch.input_ids.shape[1]
    for row, prompt in enumerate(PROMPTS):
        alone = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            expected = local.generate(**alone, max_new_tokens=6, do_sample=False)[
                0, alone.input_ids.shape[1] :
            ]
        got = outputs[row, width : width + len(expected)]
        assert tokenizer.decode(got) == tokenizer.decode(expected), prompt


def test_a_text_streamer_prints_the_answer(smol, tokenizer, capsys):
    inputs = tokenizer(PROMPTS[0], return_tensors="pt")
    outputs = smol.generate(**inputs, max_new_tokens=6, streamer=TextStreamer(tokenizer, skip_prompt=True))
    printed = capsys.readouterr().out
    assert printed.strip() == tokenizer.decode(outputs[0, inputs.input_ids.shape[1] :]).strip()


def test_what_transformers_code_reads_from_a_model(smol, local):
    assert AutoDistributedModelForCausalLM is DistributedModelForCausalLM
    assert isinstance(smol.config, PretrainedConfig)
    ours, theirs = smol.config.to_dict(), local.config.to_dict()
    assert {**ours, "_name_or_path": None} == {**theirs, "_name_or_path": None}
    assert smol.generation_config.eos_token_id == local.generation_config.eos_token_id
    assert (smol.device, smol.dtype) == (torch.device("cpu"), torch.float32)
    assert smol.eval() is smol and smol.can_generate()
