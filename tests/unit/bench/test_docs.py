"""bench/lib/docs.py: docs/benchmarks.md from the scripts' docstrings and their stamped results."""

import json

from bench.lib.docs import ENTRY_CHARS, headline, render

SCRIPT = '''"""Decode speed of something.

More detail that the docs leave out.
"""

if __name__ == "__main__":
    pass
'''


def make_bench(root):
    group = root / "bench" / "decode"
    group.mkdir(parents=True)
    (group / "__init__.py").write_text('"""Decoding on one machine."""\n')
    (group / "latency.py").write_text(SCRIPT)
    (group / "push.py").write_text(SCRIPT.replace("Decode speed of something", "Push on and off"))
    (group / "helper.py").write_text('"""A helper: no main."""\n')
    (root / "bench" / "lib").mkdir()
    (root / "bench" / "lib" / "__init__.py").write_text('"""Shared."""\n')
    return root / "bench"


def test_an_entry_shows_its_command_summary_stamp_and_result(tmp_path):
    bench = make_bench(tmp_path)
    results = tmp_path / "results"
    results.mkdir()
    stamp = {"commit": "0123456789ab", "uncommitted_changes": True, "date": "2026-12-06T07:38:32+0000",
             "cores": 2, "cpu": "x86_64", "load_average_1m": {"start": 0.54, "end": 0.78}}  # fmt: skip
    result = {"model": "SmolLM2", "ratio": 0.74, "levels": [{"sessions": 1, "tokens_per_s": 12.5}]}
    (results / "latency.json").write_text(json.dumps({"measured_on": stamp, "result": result}))
    earlier = tmp_path / "earlier.md"
    earlier.write_text("| script | what | result |\n|---|---|---|\n| `bench.decode.latency` | x | 1 |\n")

    text = render(bench, results, earlier)

    assert "## decode (`make bench-decode`)\n\nDecoding on one machine." in text
    latency = " ".join(text[text.index("### latency") : text.index("### push")].split())  # lines joined
    assert "`python -m bench.decode.latency`: Decode speed of something." in latency
    assert "More detail" not in latency
    assert "commit 0123456789ab with uncommitted changes, 2026-12-06T07:38:32+0000, 2 cores" in latency
    assert "load 0.54 at the start, 0.78 at the end" in latency
    assert "model: SmolLM2; ratio: 0.74; levels[0].sessions: 1; levels[0].tokens_per_s: 12.5" in latency
    push = text[text.index("### push") : text.index("## Earlier")]
    assert "No stamped result yet (bench/results/push.json does not exist)" in push
    assert "helper" not in text and "## lib" not in text
    assert text.endswith("## Earlier measurements (before stamped results)\n\n" + earlier.read_text())


def test_a_long_result_is_cut_at_a_value():
    result = {f"value_{i}": list(range(5)) for i in range(100)}
    shown = headline(result)
    assert len(shown) <= ENTRY_CHARS + 3 and shown.endswith("; …")
    assert shown.startswith("value_0: [0, 1, 2, 3, 4]; value_1: [0, 1, 2, 3, 4]")
    assert headline({"many": list(range(20))}).startswith("many[0]: 0; many[1]: 1")
