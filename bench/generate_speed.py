"""Decode speed as users see it (issue 15): the wall clock of `LLM.generate`, default
`EngineConfig`, for greedy and for temperature 0.7 + top_p 0.9, at several batch sizes.

The decode step is (time of max_tokens=1+N) - (time of max_tokens=1), divided by N: prefill and
start-up cancel out, as far as the two runs prefill alike (in the 1+N run, rows that finished
their prompt decode beside the others' prompt chunks, so slower mixed steps show in this figure
too; `total_s` is the whole 1+N run, what a user waits for). Prompts are random token ids
(ignore_eos, so the lengths hold).

    python bench/generate_speed.py                                   # SmolLM2-135M f32 on the CPU
    python bench/generate_speed.py --shape llama3-8b --batches 1,8,64  # random bf16 weights (GPU)

Variants per batch: greedy, temperature 0.7 + top_p 0.9 (`top_p`), and the same with logprobs=5
(`top_p_lp5`). Beside them, in the same run: the device step of the engine's own decode
executable for that batch (`measure_decode_latency`: inputs fixed, state fed back) and the
weights+KV roofline over a memcpy measured in the run. Random weights give near-uniform
logits or very peaked ones (`random_model`'s Llama-3-8B shape, 1 layer: a nucleus of 1-6 tokens),
so the bench reports the nucleus size (the model's own logits over the prompt at T=0.7), and
`--lm-head-scale auto` scales the LM head so that the median nucleus holds ~100 tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--shape", default=None, help="random weights of a named shape instead of --model")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quantization", default=None, help="fp8, int4 or nvfp4: quantize the decoder linears at load")
    p.add_argument("--lm-head-scale", default="1", help="multiply the (untied) LM head by this; "
                   "'auto': the scale that leaves a median top_p=0.9 nucleus of ~100 tokens")
    p.add_argument("--profile", default=None, help="a directory: profile the device step (top-p rows) of each "
                   "batch there (kernels, idle gaps between them)")
    p.add_argument("--engine-config", default="{}", help="JSON of EngineConfig fields set beside the defaults, "
                   'e.g. \'{"max_prefill_streams": 16}\'')
    p.add_argument("--attention", default="{}", help="JSON of AttentionConfig fields set over the device's default "
                   'kernels (a tuned variant beside the default), e.g. \'{"mosaic_prefill": false}\'')
    p.add_argument("--w4-mgpu", default="{}", help="JSON of W4MgpuParams fields set over the int4 tensor-core "
                   "kernel's defaults for more than 16 rows (a tuned variant beside the default), e.g. "
                   "'{\"overlap\": true}'")
    p.add_argument("--host-profile", default=None, help="a directory: one more 1+N run of each variant under "
                   "cProfile, its host functions by cumulative and own time (where a step the device does not "
                   "explain goes)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    import jax

    w4_mgpu = json.loads(a.w4_mgpu)
    if w4_mgpu:  # (the engine picks the kernel's tiles at trace time through this function)
        from pallas_kernels.linear import w4_mgpu as w4m

        default_params = w4m.w4_mgpu_params_for

        def tuned(m, n, k, group_size=128, **kw):
            p = default_params(m, n, k, group_size, **kw)
            return dataclasses.replace(p, **w4_mgpu) if m > 16 else p

        w4m.w4_mgpu_params_for = tuned

    from metrale_jax import LLM, LLMEngine, SamplingParams, load_model, random_model
    from metrale_jax.engine.bench import measure_decode_latency, memcpy_bandwidth, shape_config
    from metrale_jax.engine.config import EngineConfig
    from metrale_jax.metadata_builder import RowSampling

    on_gpu = jax.devices()[0].platform == "gpu"
    dtype = a.dtype or ("bfloat16" if on_gpu else "float32")
    if a.shape:
        model, params = random_model(shape_config(a.shape, a.num_layers), dtype=dtype, repeat_layers=True,
                                     split_layers=on_gpu, quantization=a.quantization)
    else:
        model, params = load_model(a.model, dtype=dtype, show_progress=False, split_layers=on_gpu,
                                   quantization=a.quantization)
    rng = np.random.default_rng(0)
    logits = prompt_logits(model, params, rng.integers(3, model.cfg.vocab_size - 1, a.prompt_len).tolist())
    scale = scale_for_nucleus(logits) if a.lm_head_scale == "auto" else float(a.lm_head_scale)
    nucleus = nucleus_sizes(logits, scale)
    del logits
    if scale != 1.0:
        if "lm_head" not in params:
            raise SystemExit("--lm-head-scale needs an untied LM head")
        params["lm_head"] = params["lm_head"] * scale
    print(f"LM head x{scale:.3g}: top_p=0.9 nucleus at T=0.7 over the prompt's positions: median "
          f"{int(np.median(nucleus))}, range {min(nucleus)}-{max(nucleus)} of {model.cfg.vocab_size} tokens",
          flush=True)
    batches = [int(b) for b in a.batches.split(",")]
    overrides = json.loads(a.engine_config)
    # On the GPU the engine's own max_model_len (the model's context, capped at 4096): the decode attention
    # splits each row's context by it, and at one row its split combine costs ~1 us a layer more at 4096 than
    # at the 512 sessions 15-51 ran with (bench/kernels/decode_attention_b1.py, session 51). On the CPU a
    # small pool (the smoke runs).
    small = {} if on_gpu else dict(max_model_len=max(512, a.prompt_len + a.steps + 8), max_num_seqs=max(batches))
    cfg = EngineConfig(**{**dict(dtype=dtype, show_progress=False), **small, **overrides})
    kernels = json.loads(a.attention)
    if kernels:
        from metrale_jax.engine.config import default_kernels

        base = cfg.attention or default_kernels(on_gpu, getattr(model, "has_experts", False))
        cfg = dataclasses.replace(cfg, attention=dataclasses.replace(base, **kernels))
    eng = LLMEngine(model, params, cfg)
    llm = LLM.from_engine(eng)
    bw, bw_how = memcpy_bandwidth()
    res = {"model": a.shape or a.model, "dtype": dtype, "quantization": a.quantization,
           "engine_config": overrides, "attention": kernels, "w4_mgpu": w4_mgpu,
           "lm_head_scale": scale, "device": str(jax.devices()[0].device_kind),
           "versions": {"jax": jax.__version__, "python": sys.version.split()[0]},
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "nucleus_tokens": {"median": int(np.median(nucleus)), "min": min(nucleus), "max": max(nucleus)},
           "memcpy_gb_s": bw / 1e9, "memcpy": bw_how, "runs": [], "device_steps": [],
           "device_steps_logprobs": []}
    variants = (("greedy", dict(temperature=0)), ("top_p", dict(temperature=0.7, top_p=0.9, seed=1)),
                ("top_p_lp5", dict(temperature=0.7, top_p=0.9, seed=1, logprobs=5)))
    # each engine step's wall time inside `generate` (where a slow generate step comes from: a few
    # long steps, every step, or time outside the steps)
    step_times: list[float] = []
    engine_step = eng.step

    def timed_step():
        t = time.perf_counter()
        out = engine_step()
        step_times.append(time.perf_counter() - t)
        return out

    eng.step = timed_step
    for b in batches:
        prompts = [{"prompt_token_ids": rng.integers(3, model.cfg.vocab_size - 1, a.prompt_len).tolist()}
                   for _ in range(b)]
        for name, kw in variants:
            def wall(n, prompts=prompts, kw=kw):
                step_times.clear()
                t = time.perf_counter()
                llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True, **kw))
                return time.perf_counter() - t, list(step_times)

            wall(1 + a.steps)  # warm
            t1, _ = min(wall(1) for _ in range(a.repeats))
            tn, steps_n = min(wall(1 + a.steps) for _ in range(a.repeats))
            step = (tn - t1) / a.steps
            ms = np.asarray(steps_n) * 1e3
            if a.host_profile:
                host_profile(lambda: wall(1 + a.steps), Path(a.host_profile) / f"host_b{b}_{name}.txt")
            res["runs"].append(dict(batch=b, sampling=name, step_ms=1e3 * step, tok_s=b / step, first_token_s=t1,
                                    engine_steps=len(ms), engine_step_ms_median=float(np.median(ms)),
                                    engine_step_ms_max=float(ms.max()), engine_steps_ms_top5=sorted(ms)[-5:],
                                    outside_steps_ms=1e3 * tn - float(ms.sum()), total_s=tn,
                                    engine_steps_ms=[round(float(x), 3) for x in ms]))
            print(f"batch {b:3d} {name:9s} {1e3 * step:8.2f} ms per decode step ({b / step:9.1f} tok/s), "
                  f"max_tokens=1 in {t1:.3f} s; "
                  f"1+N run: {len(ms)} engine steps, median {np.median(ms):.2f} ms, 5 longest "
                  f"{', '.join(f'{x:.1f}' for x in sorted(ms)[-5:])} ms, outside steps {1e3 * tn - ms.sum():.1f} ms, "
                  f"all {tn:.3f} s",
                  flush=True)
        # the device step with top-p rows, profiled on request (with the sampler's skips, the GPU
        # default since session 19, a greedy batch's step is shorter than this one)
        lat = measure_decode_latency(eng, argparse.Namespace(context=a.prompt_len, decode_steps=a.steps, seed=0,
                                                             profile=a.profile), b, bw,
                                     RowSampling(temperature=0.7, top_p=0.9, seed=(1, 0, 0)))
        res["device_steps"].append(lat)
        # the same with logprobs rows (the sampler's top logprobs on): whether logprobs=5's cost through
        # `generate` is the device's (session 48, H100, batch 1: +0.3-0.9 ms a step with 4-bit weights,
        # none with bf16's longer step)
        lat_lp = measure_decode_latency(eng, argparse.Namespace(context=a.prompt_len, decode_steps=a.steps, seed=0,
                                                                profile=None), b, bw,
                                        RowSampling(temperature=0.7, top_p=0.9, seed=(1, 0, 0), logprobs=True))
        res["device_steps_logprobs"].append(lat_lp)
    for b in batches:
        g, t, lp = (next(r for r in res["runs"] if r["batch"] == b and r["sampling"] == s) for s in
                    ("greedy", "top_p", "top_p_lp5"))
        lat = next(x for x in res["device_steps"] if x["batch"] == b)
        lat_lp = next(x for x in res["device_steps_logprobs"] if x["batch"] == b)
        print(f"batch {b:3d}: top_p costs {100 * (t['step_ms'] / g['step_ms'] - 1):+.1f}% over greedy, logprobs=5 "
              f"{100 * (lp['step_ms'] / t['step_ms'] - 1):+.1f}% more (device step with logprobs rows "
              f"{lat_lp['device_step_ms']:.2f} ms); generate greedy step "
              f"{g['step_ms'] / lat['device_step_ms']:.3f}x the device step ({lat['device_step_ms']:.2f} ms); "
              f"roofline ratio {lat['roofline_step_ms'] / g['step_ms']:.3f} (generate), "
              f"{lat['roofline_ratio_device']:.3f} (device; {bw / 1e9:.0f} GB/s {bw_how})", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


def host_profile(run, path: Path) -> None:
    """`run()` under cProfile: its functions by cumulative and by own time, written to `path`."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    run()
    prof.disable()
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("cumulative").print_stats(45)
    st.sort_stats("tottime").print_stats(30)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(s.getvalue())


def prompt_logits(model, params, tokens: list[int]):
    """f32[T, V]: the model's next-token logits at each position of `tokens` (the dense research
    forward, run before the engine takes the memory)."""
    import jax
    import jax.numpy as jnp

    return jax.jit(model.forward)(params, jnp.asarray([tokens], jnp.int32))[0]


def nucleus_sizes(logits, scale: float = 1.0, temperature: float = 0.7, top_p: float = 0.9) -> list[int]:
    """Tokens in the top_p nucleus at `temperature` of each row of scale * logits f32[T, V] (scaling
    the LM head scales the logits: the same numbers as the scaled model's)."""
    import jax
    import jax.numpy as jnp

    probs = jnp.sort(jax.nn.softmax(scale * logits / temperature, axis=-1), axis=-1)[:, ::-1]
    n = (jnp.cumsum(probs, axis=-1) < top_p).sum(axis=-1) + 1
    return [int(x) for x in jax.device_get(n)]


def scale_for_nucleus(logits, target: int = 100) -> float:
    """The LM-head scale (bisected geometrically in [1e-3, 1e3]) whose median nucleus is ~target tokens."""
    lo, hi = 1e-3, 1e3
    for _ in range(30):
        mid = (lo * hi) ** 0.5
        if float(np.median(nucleus_sizes(logits, mid))) > target:
            lo = mid
        else:
            hi = mid
    return hi


if __name__ == "__main__":
    sys.exit(main())
