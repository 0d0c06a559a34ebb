"""bench/stamp.py: a benchmark's result printed, and kept with the commit, date, cores and load it was
measured on."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

from stamp import report


def test_a_result_is_printed_and_kept_stamped(tmp_path, capsys):
    result = {"tokens_per_s": 12.5, "ratio": 0.74}
    path = report("/somewhere/bench/push.py", result, results=tmp_path)
    assert json.loads(capsys.readouterr().out) == result
    assert path == tmp_path / "push.json"
    kept = json.loads(path.read_text())
    assert kept["result"] == result
    stamp = kept["measured_on"]
    assert len(stamp["commit"]) == 12 and isinstance(stamp["uncommitted_changes"], bool)
    assert stamp["cores"] == os.cpu_count() and stamp["date"][:2] == "20"
    assert set(stamp["load_average_1m"]) == {"start", "end"}
