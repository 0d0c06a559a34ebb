"""bench/lib/stamp.py: a benchmark's result printed, and kept with the commit, date, cores and load it was
measured on."""

import json
import os

from bench.lib.stamp import compact, report


def test_a_result_is_printed_and_kept_stamped(tmp_path, capsys):
    result = {"tokens_per_s": 12.5, "ratio": 0.74}
    path = report("/somewhere/bench/decode/push.py", result, results=tmp_path)
    assert json.loads(capsys.readouterr().out) == result
    assert path == tmp_path / "push.json"
    kept = json.loads(path.read_text())
    assert kept["result"] == result
    stamp = kept["measured_on"]
    assert len(stamp["commit"]) == 12 and isinstance(stamp["uncommitted_changes"], bool)
    assert stamp["cores"] == os.cpu_count() and stamp["date"][:2] == "20"
    assert set(stamp["load_average_1m"]) == {"start", "end"}
    assert stamp["command"].startswith("python -m ")  # with the options the run was given


def test_a_short_result_prints_plain_lists_on_one_line(tmp_path, capsys):
    result = {"chains": {"A": 3, "B+C": 2}, "runs": [1, 2, 3], "nested": [{"x": 1}]}
    report("sim_vs_real.py", result, results=tmp_path, short=True)
    printed = capsys.readouterr().out
    assert json.loads(printed) == result
    assert '"chains": {"A": 3, "B+C": 2}' in printed and '"runs": [1, 2, 3]' in printed
    assert compact("[\n  1,\n  2\n]") == "[1, 2]"
