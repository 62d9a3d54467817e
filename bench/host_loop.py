"""The engine's host time per step (issue 15): `LLMEngine.step()` over a model whose device work
is negligible (`tests`' FakeModel), at batch 64, so what is measured is the host loop itself:
scheduling, building and packing the step inputs, the transfer, reading the samples back,
detokenizing, stop checks and building outputs. Prints the median step time and the functions
that take the most time (cProfile), for CUMULATIVE outputs (a streaming server) and FINAL_ONLY
(`LLM.generate`).

    python bench/host_loop.py [--batch 64] [--max-tokens 200] [--out bench/results/host_loop.json]

Compare with the device step of the model you serve: the host must stay below 0.9x of it so
the device never waits (steps are dispatched one ahead).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(batch: int, max_tokens: int, kind, profile: bool) -> dict:
    import numpy as np

    from metrale_jax.engine.testing import fake_engine
    from metrale_jax.sampling import SamplingParams

    eng = fake_engine(use_ssm=False, max_model_len=512, num_kv_blocks=max(batch * 40, 256), max_num_seqs=batch,
                      max_num_batched_tokens=2048, decode_buckets=(batch,), mixed_decode_buckets=(batch,),
                      prefill_buckets=(2048,), max_prefill_streams=4)
    rng = np.random.default_rng(0)
    sp = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=max_tokens, ignore_eos=True, seed=1,
                        stop=["never-matches"], output_kind=kind)
    for i in range(batch):
        eng.add_request(f"r{i}", {"prompt_token_ids": rng.integers(3, 60, 32).tolist()}, sp)
    for _ in range(3):  # prefill and the first decode steps
        eng.step()
    prof = cProfile.Profile() if profile else None
    times = []
    if prof:
        prof.enable()
    while eng.has_unfinished_requests():
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    if prof:
        prof.disable()
    res = dict(kind=kind.name, batch=batch, steps=len(times), median_step_ms=1e3 * float(np.median(times)))
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
        res["profile"] = s.getvalue()
    return res


def main() -> int:
    from metrale_jax.sampling import RequestOutputKind

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    kinds = (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY)
    out = [run(a.batch, a.max_tokens, k, a.profile) for k in kinds]
    for r in out:
        print(f"{r['kind']:10s} batch {r['batch']}: {r['median_step_ms']:.2f} ms per step (host + a tiny device step)")
        if "profile" in r:
            print(r["profile"])
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
