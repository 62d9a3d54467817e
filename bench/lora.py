"""Multi-LoRA decode cost (issue 18): the time of a decode step with LoRA rows against the same
step of an engine without LoRA, on random weights of a real shape: steps dispatched back to back
(as `generate` runs them; the headline ratios) and steps waited for one by one (launch included).

    python bench/lora.py --shape llama3-8b --batches 1,64 --num-adapters 8 --rank 16 \
        [--kernels auto,masked,gather] [--out bench/results/lora.json]
    python bench/lora.py --shape smollm2-135m --num-layers 2 --batches 1,4 --num-adapters 2 --steps 3  # CPU smoke

Cases per batch B (context --context tokens per row, one decode executable of bucket B):
* `base`: an engine built without LoRA (no LoRA leaves in the step at all): the denominator;
* `lora_none`: the LoRA engine, every row on the base model (seq_slot = -1): the price of
  having slots at all;
* `lora_mixed`: the LoRA engine, row i on adapter i % num_adapters (batch 1: one adapter);
each for every `--kernels` choice (`AttentionConfig.lora_kernel`). The adapters target all
seven projections (q/k/v/o, gate/up/down) at rank --rank with random weights (the step's cost
does not depend on the values), written straight into the slots (no PEFT files: 8 rank-16
adapters of Llama-3-8B would be 1.3 GB of safetensors). Bars (issue 18, H200, Llama-3-8B shape):
batch 64 with 8 adapters <= 1.3x base (goal 1.15x), batch 1 with one adapter <= 1.1x.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _time_decode(eng, batch: int, context: int, steps: int, slots: list[int],
                 profile: Path | None = None) -> tuple[float, float]:
    """Seconds per step of the bucket-`batch` decode step, rows with `context` tokens of (zero)
    cache in blocks of their own and LoRA slot slots[i] (-1 = base): (pipelined: `steps` steps
    dispatched back to back, one wait at the end, as `generate` runs them, i.e. the device time
    when the host launches faster than the device runs; synchronous: the median of `steps` steps
    each waited for, launch included)."""
    import jax
    import numpy as np

    from metrale_jax.metadata_builder import DecodeRow, RowSampling, build_step

    bs = eng.config.block_size
    nb = -(-(context + 1) // bs)
    rows = [DecodeRow(token=3, position=context, block_table=list(range(i * nb, (i + 1) * nb)),
                      sampling=RowSampling(), lora_slot=s) for i, s in enumerate(slots)]
    inputs = build_step(eng.builder, eng.compiler.bucket_for(batch, 0, 0), rows, [])
    dev = eng.compiler.transfer(inputs)
    state = eng.state
    for _ in range(2):
        state, out, _ = eng.compiler.run(inputs.bucket, eng.params, state, dev)
    jax.block_until_ready(out.token_ids)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, out, _ = eng.compiler.run(inputs.bucket, eng.params, state, dev)
        jax.block_until_ready(out.token_ids)
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, out, _ = eng.compiler.run(inputs.bucket, eng.params, state, dev)
    jax.block_until_ready(out.token_ids)
    pipelined = (time.perf_counter() - t0) / steps
    if profile is not None:  # the device kernels of these steps, by name (engine.bench.profile_calls),
        import gzip  # and the forward executable's optimized HLO (what each fusion name computes)

        from metrale_jax.engine.bench import profile_calls

        profile.mkdir(parents=True, exist_ok=True)
        with gzip.open(profile / "forward_hlo.txt.gz", "wt") as f:
            f.write(eng.compiler.executable_of(inputs.bucket).as_text())

        box = [state]

        def run():
            box[0], o, _ = eng.compiler.run(inputs.bucket, eng.params, box[0], dev)
            return o.token_ids
        profile_calls(run, profile, steps)
        state = box[0]
    eng.state = state
    return pipelined, float(np.median(times))


def _fill_adapters(eng, n: int, rank: int, seed: int) -> list[int]:
    """Register n random adapters (all seven targets, `rank`) and write them into slots 0..n-1."""
    import numpy as np

    from metrale_jax.lora.adapter import HostAdapter
    from metrale_jax.lora.request import LoRARequest

    mgr = eng.lora
    spec = mgr.spec
    rng = np.random.default_rng(seed)
    for i in range(1, n + 1):
        w = {}
        for k, shape in spec.leaf_shapes(1).items():
            w[k] = (rng.standard_normal(shape, dtype=np.float32) * 0.01).astype(mgr.dtype)  # values do not matter
        req = LoRARequest(f"bench{i}", i, "")
        mgr.registered[i] = req
        mgr.host[i] = HostAdapter(i, req.lora_name, "", rank, w, spec.num_experts > 0, ())
    eng.params, slot_of = mgr.slots_for(eng.params, range(1, n + 1), set())
    return [slot_of[i] for i in range(1, n + 1)]


def _drop(eng, keep) -> None:
    """Free an engine's KV / SSM pools and the weights it made (a LoRA engine's widened copies)
    now, all but the arrays of `keep` (the shared base params): the next engine sizes its pool
    from the memory left (the default config), and on the H200 (session 15) one made after `del`
    of the last saw a negative pool."""
    import gc

    import jax

    def buf(a):
        return a.unsafe_buffer_pointer() if isinstance(a, jax.Array) and not a.is_deleted() else None

    shared = {buf(a) for a in jax.tree.leaves(keep)}
    own = [a for a in jax.tree.leaves(eng.params) if isinstance(a, jax.Array) and buf(a) not in shared]
    for a in jax.tree.leaves(eng.state) + own:
        a.delete()
    del eng
    gc.collect()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--num-adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-loras", default=None, help="slots, comma-separated values each timed (default: "
                   "--num-adapters); batch 1 uses one adapter either way")
    p.add_argument("--profile", metavar="DIR", default=None, help="profile the base and adapter steps (kernel "
                   "times by name, and the optimized HLO of each forward executable)")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--kernels", default="auto,masked,gather")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tuned", action="store_true", help="decode buckets of the batches only, a pool just large "
                   "enough, no top logprobs (the figures before session 12) instead of the default EngineConfig")
    p.add_argument("--attention", default="{}", help="JSON of AttentionConfig fields set over the device's default "
                   "kernels for every case, base included (a tuned variant), e.g. '{\"xla_remat\": false}'")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import jax

    from metrale_jax.engine.bench import shape_config
    from metrale_jax.engine.config import EngineConfig, default_kernels
    from metrale_jax.engine.engine import LLMEngine
    from metrale_jax.model import random_model

    on_gpu = jax.devices()[0].platform == "gpu"
    dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    batches = sorted({int(b) for b in args.batches.split(",")})
    kernels = [k for k in args.kernels.split(",") if k]
    attn0 = dataclasses.replace(default_kernels(on_gpu), **json.loads(args.attention))
    attn_lora = dataclasses.replace(default_kernels(on_gpu, lora=True), **json.loads(args.attention))  # (no XLA remat)
    model, params = random_model(shape_config(args.shape, args.num_layers), dtype=dtype, seed=args.seed,
                                 repeat_layers=True, split_layers=attn0.unroll_layers)
    bs = 16
    nb = -(-(args.context + 1) // bs)
    tuned = dict(num_kv_blocks=max(batches) * nb + 8, max_num_seqs=max(batches),
                 max_num_batched_tokens=max(256, max(batches)), decode_buckets=tuple(batches),
                 prefill_buckets=(max(256, max(batches)),), max_prefill_streams=1, max_logprobs=0)
    cfg = EngineConfig(dtype=dtype, max_model_len=args.context + 64, block_size=bs, show_progress=False,
                       attention=attn0, **(tuned if args.tuned else {}))
    res = dict(shape=args.shape, num_layers=model.cfg.num_layers, dtype=dtype, device=str(jax.devices()[0]),
               jax=jax.__version__, date=time.strftime("%Y-%m-%d"), num_adapters=args.num_adapters, rank=args.rank,
               context=args.context, engine_config="tuned" if args.tuned else "default",
               attention=json.loads(args.attention), cases=[])
    base = LLMEngine(model, params, cfg)
    prof = (lambda name: Path(args.profile) / name) if args.profile else (lambda name: None)
    base_t = {b: _time_decode(base, b, args.context, args.steps, [-1] * b, prof(f"base_b{b}")) for b in batches}
    _drop(base, params)
    for kern, slots_n in [(k, int(n)) for k in kernels for n in (args.max_loras or str(args.num_adapters)).split(",")]:
        lcfg = dataclasses.replace(cfg, enable_lora=True, max_loras=slots_n, max_lora_rank=args.rank,
                                   max_cpu_loras=max(slots_n, args.num_adapters),
                                   attention=dataclasses.replace(attn_lora, lora_kernel=kern))
        eng = LLMEngine(model, params, lcfg)
        slots = _fill_adapters(eng, min(slots_n, args.num_adapters), args.rank, args.seed)
        for b in batches:
            (none, none_sync), (mixed, mixed_sync) = (
                _time_decode(eng, b, args.context, args.steps, s_, p_) for s_, p_ in
                (([-1] * b, None), ([slots[i % len(slots)] for i in range(b)], prof(f"{kern}_s{slots_n}_b{b}"))))
            (bt, bt_sync) = base_t[b]
            case = dict(kernel=kern, batch=b, base_ms=bt * 1e3, lora_none_ms=none * 1e3,
                        lora_mixed_ms=mixed * 1e3, adapters_in_batch=min(b, len(slots)), max_loras=slots_n,
                        ratio_none=none / bt, ratio_mixed=mixed / bt,
                        sync=dict(base_ms=bt_sync * 1e3, lora_none_ms=none_sync * 1e3,
                                  lora_mixed_ms=mixed_sync * 1e3, ratio_mixed=mixed_sync / bt_sync))
            res["cases"].append(case)
            print(f"{kern:7s} {slots_n} slots, batch {b:3d}: base {case['base_ms']:.3f} ms, "
                  f"lora rows none {case['lora_none_ms']:.3f} "
                  f"ms ({case['ratio_none']:.3f}x), {case['adapters_in_batch']} adapters {case['lora_mixed_ms']:.3f} "
                  f"ms ({case['ratio_mixed']:.3f}x); steps waited for one by one: base {bt_sync * 1e3:.3f} ms, "
                  f"adapters {mixed_sync * 1e3:.3f} ms ({mixed_sync / bt_sync:.3f}x)", flush=True)
        _drop(eng, params)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
