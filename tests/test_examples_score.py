"""The scoring example runs, and a fluent sentence scores better than word salad."""

import runpy
import sys
from pathlib import Path

EXAMPLE = Path(__file__).parent.parent / "examples" / "score.py"


def test_score_example(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE)])
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    fluent, salad = (float(line.split()[0]) for line in lines)
    assert 1.0 < fluent < salad
