"""bench/gpu_acceptance.py: its --cpu-smoke run passes on tiny shapes, and its checks fail on
doctored outputs (a check that cannot fail would pass a broken engine on the GPU)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from metrale_jax.engine.outputs import Logprob
from metrale_jax.sampling import SamplingParams

_PATH = Path(__file__).resolve().parents[1] / "bench" / "gpu_acceptance.py"
_spec = importlib.util.spec_from_file_location("gpu_acceptance", _PATH)
acc = importlib.util.module_from_spec(_spec)
sys.modules["gpu_acceptance"] = acc
_spec.loader.exec_module(acc)


def _run(tmp_path: Path, family: str) -> dict:
    rc = acc.main(["--cpu-smoke", "--family", family, "--out", str(tmp_path)])
    (path,) = tmp_path.glob("acceptance_*_cpu_smoke.json")
    report = json.loads(path.read_text())
    assert (tmp_path / path.name.replace(".json", ".md")).is_file()
    return rc, report


def _assert_passed(rc: int, report: dict, family: str) -> dict:
    (res,) = report["families"]
    failed = {k: c for k, c in res["checks"].items() if c["passed"] is not True}
    assert res["error"] is None and not failed, (res.get("traceback"), failed)
    assert rc == 0 and report["passed"] and res["passed"] and res["family"] == family
    # every part ran: the server, the lone greedy reruns, the twins; the traffic preempted
    assert set(acc.CHECK_ORDER) <= set(res["checks"])
    assert res["traffic"]["preemptions"] > 0 and res["traffic"]["aborted"] >= 3
    assert res["checks"]["greedy_alone"]["compared"] >= 2
    assert res["checks"]["server"]["requests"] > 0
    return res


@pytest.mark.slow  # (the GPU session runs the real thing; the checks below run in CI)
def test_cpu_smoke_llama(tmp_path):
    rc, report = _run(tmp_path, "llama3-8b")
    res = _assert_passed(rc, report, "llama3-8b")
    assert res["preemption_mode"] == "recompute" and res["traffic"]["swaps"] == 0


@pytest.mark.slow
def test_cpu_smoke_hybrid_swaps(tmp_path):
    rc, report = _run(tmp_path, "nemotron-h-8b")
    res = _assert_passed(rc, report, "nemotron-h-8b")
    assert res["preemption_mode"] == "swap" and res["traffic"]["swaps"] > 0


# ---- the checks on doctored outputs --------------------------------------------------------------
def _out(ids, finish="length", stop_reason=None, logprobs=None, n=1, prompt_logprobs=None, finished=True):
    outs = [SimpleNamespace(index=i, token_ids=list(ids), finish_reason=finish, stop_reason=stop_reason,
                            logprobs=logprobs) for i in range(n)]
    return SimpleNamespace(request_id="r", finished=finished, outputs=outs, prompt_logprobs=prompt_logprobs)


def _lp(token, top):
    """A logprobs entry: `top` = [(id, logprob), ...] in rank order, the chosen token among them."""
    d = {t: Logprob(lp, r + 1, None) for r, (t, lp) in enumerate(top)}
    d.setdefault(token, Logprob(-9.0, 99, None))
    return d


EOS = (2,)


def test_check_request_accepts_good_outputs():
    p = SamplingParams(max_tokens=4, stop_token_ids=[7])
    assert acc.check_request(_out([5, 6, 8, 9]), [3, 4], p, EOS, 64) == []
    assert acc.check_request(_out([5, 7], "stop", 7), [3, 4], p, EOS, 64) == []
    assert acc.check_request(_out([5, 2], "stop"), [3, 4], p, EOS, 64) == []  # EOS
    # the context cap: a 62-token prompt at max_model_len 64 leaves 2 tokens
    assert acc.check_request(_out([5, 6]), list(range(62)), p, EOS, 64) == []
    s = SamplingParams(max_tokens=4, stop=["k1"])
    assert acc.check_request(_out([5], "stop", "k1"), [3], s, EOS, 64) == []
    lp = SamplingParams(max_tokens=2, logprobs=2, prompt_logprobs=1, n=2)
    ent = [_lp(5, [(5, -0.1), (6, -2.0)]), _lp(6, [(9, -0.5), (6, -1.0)])]
    plp = [None, _lp(4, [(4, -1.0)]), _lp(8, [(1, -0.2)])]
    assert acc.check_request(_out([5, 6], logprobs=ent, n=2, prompt_logprobs=plp), [3, 4, 8], lp, EOS, 64) == []


@pytest.mark.parametrize("out, why", [
    (_out([5, 6, 8]), "length after 3 tokens"),  # one short of max_tokens
    (_out([5, 6, 8, 9, 1]), "length after 5"),
    (_out([5, 6], "stop", 6), "not a stop id"),
    (_out([5, 7, 8, 9]), "generated before the end"),  # a stop id it ran past
    (_out([5, 2, 8, 9]), "generated before the end"),  # EOS too
    (_out([5], "abort"), "finish_reason 'abort'"),
    (_out([5, 6, 8, 9], finished=False), "not finished"),
    (_out([5, 6, 8, 9], n=2), "2 outputs for n=1"),
])
def test_check_request_catches(out, why):
    p = SamplingParams(max_tokens=4, stop_token_ids=[7])
    bad = acc.check_request(out, [3, 4], p, EOS, 64)
    assert any(why in b for b in bad), bad


def test_check_request_catches_bad_logprobs():
    p = SamplingParams(max_tokens=2, logprobs=2)
    short = [_lp(5, [(5, -0.1), (6, -2.0)])]  # one entry for two tokens
    assert any("1 logprob entries" in b for b in acc.check_request(_out([5, 6], logprobs=short), [3], p, EOS, 64))
    thin = [_lp(5, [(5, -0.1)]), _lp(6, [(6, -0.1)])]  # fewer than logprobs=2 entries
    assert any("bad logprobs" in b for b in acc.check_request(_out([5, 6], logprobs=thin), [3], p, EOS, 64))
    pp = SamplingParams(max_tokens=1, prompt_logprobs=1)
    missing = [None, _lp(4, [(4, -1.0)])]  # 2 entries for 3 prompt tokens
    assert any("prompt_logprobs has 2" in b
               for b in acc.check_request(_out([5], prompt_logprobs=missing), [3, 4, 8], pp, EOS, 64))
    wrong = [None, _lp(9, [(9, -1.0)]), _lp(8, [(8, -1.0)])]  # token 4 missing from its entry
    assert any("bad prompt_logprobs" in b
               for b in acc.check_request(_out([5], prompt_logprobs=wrong), [3, 4, 8], pp, EOS, 64))


def test_compare_greedy():
    gaps = [1.0, 0.5, 0.01, 1.0]  # the lone run is near a tie at position 2
    assert acc.compare_greedy([1, 2, 3, 4], [1, 2, 3, 4], gaps)["status"] == "match"
    assert acc.compare_greedy([1, 2, 9, 9], [1, 2, 3, 4], gaps)["status"] == "diverged_after_near_tie"
    r = acc.compare_greedy([1, 9, 3, 4], [1, 2, 3, 4], gaps)
    assert r["status"] == "mismatch" and r["first_diff"] == 1 and r["first_near_tie"] == 2
    assert acc.compare_greedy([1, 2], [1, 2, 3, 4], [1.0] * 4)["status"] == "mismatch"  # stopped early
    assert acc.compare_greedy([1, 9], [1, 2], [1.0, 1.0])["status"] == "mismatch"  # no tie anywhere
    ent = [_lp(5, [(5, -0.1), (6, -0.3)]), _lp(7, [(7, -0.2), (8, -0.21)])]
    assert acc.top2_gaps(ent) == pytest.approx([0.2, 0.01])


def test_compare_greedy_noise_rule():
    """16-bit runs: a divergence before a near tie passes only where each run's token is among the
    other's top logprobs; the noise is the largest logprob difference of the same token before it."""
    lone = [_lp(1, [(1, -0.5), (2, -0.9)]), _lp(3, [(3, -0.6), (4, -0.7), (5, -3.0)])]
    swapped = [_lp(1, [(1, -0.45), (2, -0.95)]), _lp(4, [(4, -0.6), (3, -0.65)])]
    far = [_lp(1, [(1, -0.45), (2, -0.95)]), _lp(9, [(9, -0.1), (8, -2.0)])]
    gaps = acc.top2_gaps(lone)  # 0.4, 0.1: no near tie
    r = acc.compare_greedy([1, 4], [1, 3], gaps, batch_lps=swapped, lone_lps=lone, allow_noise=True)
    assert r["status"] == "diverged_within_noise" and r["noise"] == pytest.approx(0.05) and r["in_top_at_diff"]
    strict = acc.compare_greedy([1, 4], [1, 3], gaps, batch_lps=swapped, lone_lps=lone)  # float32: fails
    assert strict["status"] == "mismatch"
    r = acc.compare_greedy([1, 9], [1, 3], gaps, batch_lps=far, lone_lps=lone, allow_noise=True)
    assert r["status"] == "mismatch" and r["in_top_at_diff"] is False  # a token the lone run never ranked
    assert acc.compare_greedy([1, 3], [1, 3], gaps, batch_lps=lone, lone_lps=lone)["noise"] == 0.0


def test_compare_twins():
    ref = [_lp(5, [(5, -0.1), (6, -2.0)]), _lp(7, [(7, -0.2), (8, -0.2004)])]
    close = [_lp(5, [(5, -0.1005), (6, -2.0)]), _lp(7, [(7, -0.2), (8, -0.2)])]
    assert acc.compare_twins([5, 7], ref, [5, 7], close)["passed"]
    far = [_lp(5, [(5, -0.1), (6, -2.01)]), _lp(7, [(7, -0.2), (8, -0.2)])]
    r = acc.compare_twins([5, 7], ref, [5, 7], far)
    assert not r["passed"] and r["max_logprob_err"] == pytest.approx(0.01)
    r = acc.compare_twins([5, 7], ref, [6, 7], close)  # a clear winner flipped: fails
    assert not r["passed"] and r["first_diff"] == 0 and not r["tie_at_diff"]
    r = acc.compare_twins([5, 7], ref, [5, 8], close)  # a tie within 1e-3 flipped: reported, passes
    assert r["passed"] and r["tie_at_diff"]
    assert not acc.compare_twins([5, 7], ref, [5], close[:1])["passed"]  # stopped short


def test_check_pool_and_verdict():
    from metrale_jax.engine.scheduler import Scheduler

    sched = Scheduler(num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=8, max_prefill_streams=1,
                      max_prefill_tokens=8, num_ssm_slots=2, uses_ssm=True)
    eng = SimpleNamespace(scheduler=sched, has_unfinished_requests=lambda: False)
    assert acc.check_pool(eng) == []
    blocks = sched.blocks.allocate(2)
    sched.blocks.share(blocks[:1])
    sched.ssm_slots.allocate()
    bad = acc.check_pool(eng)
    assert any("2 KV blocks with a nonzero reference count" in b for b in bad)
    assert any("1 SSM slots held" in b for b in bad)
    res = {"error": None, "checks": {"a": acc.check(True), "server": acc.check(None, skipped="no fastapi")}}
    assert acc.family_passed(res)
    res["checks"]["pool_empty"] = acc.check(False, problems=bad)
    assert not acc.family_passed(res)
    assert not acc.family_passed({"error": "RuntimeError: boom", "checks": {}})
    assert "FAIL pool_empty" in acc.table([{**res, "family": "x", "passed": False}])


def test_synthetic_tokenizer_and_lengths():
    import numpy as np

    tok = acc.synthetic_tokenizer(300, (2,))
    assert tok.decode([0, 27, 2, 53]) == "a0b1b2"  # EOS is special: skipped
    assert tok.eos_token_ids == (2,) and tok.is_special(2)
    ls = acc.lengths(np.random.default_rng(0), 50, 1, 1500)
    assert min(ls) == 1 and max(ls) == 1500 and len(ls) == 50
    assert math.isclose(np.median(ls), 40, rel_tol=2)  # log-uniform: most prompts short, some long
