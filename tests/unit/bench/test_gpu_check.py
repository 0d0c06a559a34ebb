"""The GPU check's pure parts: which wheels a GPU image needs beyond its own packages, and how the check
reads its steps' output."""

from packaging.requirements import Requirement

from bench.gpu.check import last_json, pytest_summary
from bench.gpu.prepare import closure, satisfied, to_fetch


def test_the_image_keeps_what_satisfies_corolla_and_nothing_of_the_cuda_stack_is_fetched():
    needed = closure(("corolla",))
    assert {"transformers", "hivemind", "torch", "numpy"} <= set(needed)
    # an image holding transformers 5.17 and tokenizers at an unknown version, nothing else
    fetch = to_fetch({"transformers": "5.17.0", "tokenizers": None, "numpy": "1.0"}, [])
    assert fetch["transformers"] == needed["transformers"][0]  # too old for corolla: fetched, as tested here
    assert "tokenizers" not in fetch  # a name without a version satisfies
    assert "numpy" in fetch  # below what some package asks for
    assert "torch" not in fetch and not any(name.startswith("nvidia-") for name in fetch)
    assert "torchao" in fetch and "bitsandbytes" not in fetch
    assert "bitsandbytes" in to_fetch({}, ["bitsandbytes"])


def test_versions_against_every_requirement_on_them():
    requirements = [Requirement("x>=1.2"), Requirement("x<2")]
    assert satisfied("1.5", requirements) and satisfied(None, requirements)
    assert not satisfied("2.0", requirements) and not satisfied("not-a-version", requirements)


def test_a_steps_output_is_read_from_its_last_json_object_and_pytests_summary():
    logs = 'loading...\n{"a": 1}\nmore logs\n{\n  "b": {"c": 2}\n}\n'
    assert last_json(logs) == {"b": {"c": 2}}
    summary = pytest_summary("....\n4 passed, 3 skipped in 12.0s\n")
    assert summary == {"tests": {"passed": 4, "skipped": 3}, "ok": True}
    assert not pytest_summary("1 failed, 2 passed in 3s")["ok"]
