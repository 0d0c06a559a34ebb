"""Speculative decoding through the OpenAI API: `corolla api --draft lookup` over a real SmolLM2 swarm
answers the same with speculation on and off. (Speculation through servers, without the API process:
tests/unit/client/test_speculation.py.)"""

from __future__ import annotations

import json
import urllib.request


def test_the_api_with_a_drafter_answers_the_same_with_speculation_on_and_off(smol_swarm):
    process = smol_swarm.add_api(extra_args=["--draft", "lookup", "--max-model-len", "1024"])
    try:
        sentence = "Seven silver swans swam slowly south across the silent lake at dawn."
        answers = []
        for speculative in (True, False):
            body = {
                "model": "SmolLM2-135M-Instruct",
                "messages": [{"role": "user", "content": f"Repeat exactly: {sentence}"}],
                "max_tokens": 32,
                "temperature": 0,
                "speculative": speculative,
            }
            request = urllib.request.Request(
                f"{process.url}/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=60) as response:
                answers.append(json.load(response)["choices"][0]["message"]["content"])
        assert answers[0] == answers[1] and answers[0]
    finally:
        process.stop()
        smol_swarm.apis.remove(process)
