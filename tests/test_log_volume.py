"""What a user sees while an engine starts and generates: a few lines, no floods.

The tiny Qwen3-MoE fixture (the routed-experts path, traced once per step executable) with the
default `EngineConfig` except `show_progress=False` and two sizes (max_num_seqs=2,
max_num_batched_tokens=32: fewer step executables than the 11 of the defaults, for a fast test; the default
buckets would only add more of the same compiles). Counted as the CLI shows them (cli.py: the
root logger at WARNING, `metrale_jax` at INFO): every log record that passes those levels, every
line written to the stderr file descriptor (C++ logs, prints, progress bars) and every Python
warning the default filters show. The second case injects one warning per layer and checks that
the same measurement then fails.
"""

from __future__ import annotations

import collections
import logging
import warnings

import pytest

from metrale_jax import load_model
from metrale_jax.engine.config import EngineConfig
from metrale_jax.engine.engine import LLMEngine
from metrale_jax.sampling import SamplingParams
from tests.conftest import FIXTURES

MAX_WARNINGS = 10  # records at WARNING or above (a clean run has none)
MAX_LINES = 15  # everything a user sees: records that pass the CLI's levels, stderr lines, Python warnings
MAX_REPEATS = 2  # the same message template from the same logger


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.NOTSET)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _violations(records: list[logging.LogRecord], stderr: str, py_warnings: list) -> list[str]:
    """What breaks the budget, as readable strings (empty: within it)."""
    out = []
    n_warn = sum(r.levelno >= logging.WARNING for r in records)
    if n_warn > MAX_WARNINGS:
        out.append(f"{n_warn} records at WARNING+ (> {MAX_WARNINGS})")
    err_lines = [line for line in stderr.splitlines() if line.strip()]
    total = len(records) + len(err_lines) + len(py_warnings)
    if total > MAX_LINES:
        out.append(f"{total} lines seen (> {MAX_LINES}): {len(records)} records, {len(err_lines)} stderr lines "
                   f"{err_lines[:5]}, {len(py_warnings)} Python warnings")
    repeats = collections.Counter((r.name, str(r.msg)) for r in records)
    repeats.update(("stderr", line) for line in err_lines)
    repeats.update(("warnings", str(w.message)) for w in py_warnings)
    out += [f"{n} times from {name}: {msg[:200]!r}" for (name, msg), n in repeats.items() if n > MAX_REPEATS]
    return out


def _start_and_generate(capfd) -> list[str]:
    """Build the engine and generate two short requests with the CLI's log levels; the violations."""
    handler = _Records()
    root, ours = logging.getLogger(), logging.getLogger("metrale_jax")
    saved = root.level, ours.level
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    ours.setLevel(logging.INFO)
    capfd.readouterr()  # drop what came before
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")  # what a user's interpreter shows: each warning once per place
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            warnings.filterwarnings("ignore", category=PendingDeprecationWarning)
            model, params = load_model(FIXTURES / "qwen3_moe_tiny", dtype="float32", show_progress=False)
            eng = LLMEngine(model, params, EngineConfig(show_progress=False, max_num_seqs=2, max_num_batched_tokens=32))
            outs = eng.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": list(range(3, 50))}],
                                SamplingParams(temperature=0, max_tokens=5))
    finally:
        root.removeHandler(handler)
        root.setLevel(saved[0])
        ours.setLevel(saved[1])
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5]
    return _violations(handler.records, capfd.readouterr().err, list(caught))


def test_start_up_and_generate_print_a_few_lines(capfd):
    assert _start_and_generate(capfd) == []


def test_a_warning_per_layer_breaks_the_budget(capfd, monkeypatch):
    """The same measurement must fail when the loader warns once per layer. (At load, not at trace
    time: a warm executable cache skips tracing, so a warning there would not show on a rerun.)"""
    from metrale_jax.loading.weights import WeightReader

    real = WeightReader.progress

    def noisy(self, it, desc):
        for i in real(self, it, desc):
            logging.getLogger("metrale_jax.loading.weights").warning("layer %s read the slow way", i)
            yield i

    monkeypatch.setattr(WeightReader, "progress", noisy)
    found = _start_and_generate(capfd)
    assert any("read the slow way" in v for v in found), found


@pytest.mark.parametrize("n", [3, 11])
def test_budget_counts_repeats_and_volume(n):
    """The checker alone: n copies of one warning break it (repeats; and the volume at 11)."""
    recs = [logging.LogRecord("metrale_jax.x", logging.WARNING, __file__, 1, "layer %d fell back", (i,), None)
            for i in range(n)]
    found = _violations(recs, "", [])
    assert any("3 times" in v or "11 times" in v for v in found)
    assert (n > MAX_WARNINGS) == any("WARNING+" in v for v in found)
    assert _violations(recs[:2], "one line\n", []) == []
