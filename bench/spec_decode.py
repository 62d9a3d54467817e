"""Speculative decoding benchmarks (issue 16), through `LLM.generate`.

acceptance (CPU is fine): the real SmolLM2-135M-Instruct GGUF, greedy, n-gram drafts (k = 4) on
    a prompt with repeated context (a passage, then a request to repeat it): accepted draft
    tokens per verify row (bonus excluded), and that the output equals plain greedy decoding.

cost (for the GPU; a tiny shape on the CPU to check it runs): random weights of `--shape`
    (default llama3-8b, bf16 on the GPU), at each `--batches` size:
    * decode step: plain engine, (wall(1 + N steps) - wall(1 step)) / N;
    * verify step (k drafts): a drafter that always proposes k tokens (the same bucket cost
      whatever is accepted), (wall(long) - wall(short)) / (engine steps between them); with
      `--method mtp` the step also runs the model's MTP head (random weights) for the next drafts;
    * the ratio verify / decode (issue bars: <= 1.25 at batch 1, <= 1.6 at batch 64);
    * end to end, the real n-gram drafter on greedy random weights (which, at these sizes, do
      not fall into loops: few drafts, none right), then on the same weights made to loop
      (`_looping`: every draft right): generated tokens/s with and without speculation (best of
      --repeats), acceptance per verify row.

host (CPU): the engine's host loop per step over FakeModel (negligible device work), batch 64:
    plain (steps dispatched one ahead), speculation finding few drafts (synchronous stepping), and
    speculation with drafts that are always right (an oracle), as step time and tokens/s.

    python bench/spec_decode.py acceptance
    python bench/spec_decode.py host
    python bench/spec_decode.py cost --shape llama3-8b --batches 1,64          # GPU
    python bench/spec_decode.py cost --shape qwen3-next-80b-a3b --num-layers 12 --method mtp   # GPU: MTP
    python bench/spec_decode.py cost --shape smollm2-135m --num-layers 2 --batches 1,4 --steps 8   # CPU check
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PASSAGE = ("The lighthouse keeper climbed the stairs at dusk, counted one hundred and twelve steps, "
           "lit the lamp, wound the clockwork that turned the lens, and wrote the time in the log. "
           "Every night for thirty years he did the same, and every night the ships passed safely.")


def _stats(llm):
    s = llm.stats()
    return s.spec_num_drafts, s.spec_draft_tokens, s.spec_accepted_tokens, s.num_steps


def acceptance(a) -> dict:
    from metrale_jax import LLM, LLMEngine, SamplingParams, load_model
    from metrale_jax.engine.config import EngineConfig

    model, params = load_model(a.model, dtype="float32", show_progress=False)
    tok = model.tokenizer
    msgs = [{"role": "user", "content": f"{PASSAGE}\n\nRepeat the text above word for word."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    base = EngineConfig(dtype="float32", max_model_len=512, max_num_seqs=4, decode_buckets=(1, 4),
                        mixed_decode_buckets=(4,), show_progress=False)
    res = {"model": a.model, "prompt_tokens": len(ids), "k": a.k}
    plain = LLM.from_engine(LLMEngine(model, params, base))
    t = time.perf_counter()
    ref = plain.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0].outputs[0]
    res["plain_s"] = time.perf_counter() - t
    spec = LLM.from_engine(LLMEngine(model, params, base.replace(
        speculative_config={"method": "ngram", "num_speculative_tokens": a.k})))
    t = time.perf_counter()
    got = spec.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0].outputs[0]
    res["spec_s"] = time.perf_counter() - t
    nd, ntok, acc, steps = _stats(spec)
    res.update(generated=len(got.token_ids), same_as_plain=got.token_ids == ref.token_ids, spec_num_drafts=nd,
               spec_draft_tokens=ntok, spec_accepted_tokens=acc, engine_steps=steps,
               accepted_per_verify_row=acc / max(nd, 1), text=got.text[:400])
    return res


def _looping(params: dict) -> dict:
    """A model whose greedy output repeats each row's last token (so n-gram drafts are right): the
    attention and MLP outputs zeroed (the same GEMMs and bytes), the LM head the embeddings. Random
    weights do not fall into loops by themselves (H200 runs: 0 accepted drafts)."""
    import jax
    import jax.numpy as jnp

    layers = dict(params["layers"])
    for name in ("wo", "w_down"):
        layers[name] = jax.tree.map(jnp.zeros_like, layers[name])
    out = {**params, "layers": layers}
    if "lm_head" in params:  # (tied embeddings: the head is the embeddings already)
        out["lm_head"] = params["embed"].T.astype(params["lm_head"].dtype)
    return out


def _e2e(llm, prompts, n: int, repeats: int, params_of=None) -> tuple[float, list[int]]:
    """Generated tokens/s of greedy `LLM.generate` of n tokens per prompt, best of `repeats`, and
    that run's (verify rows with drafts, draft tokens, accepted, steps); with the engine's weights
    replaced by `params_of(weights)` meanwhile when given."""
    from metrale_jax import SamplingParams

    eng = llm.llm_engine
    real = eng.params
    if params_of is not None:
        eng.params = params_of(real)
    best = (0.0, [])
    try:
        for _ in range(repeats):
            st0 = _stats(llm)
            t = time.perf_counter()
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
            tok_s = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
            if tok_s > best[0]:
                best = (tok_s, [x - y for x, y in zip(_stats(llm), st0)])
    finally:
        eng.params = real
    return best


def cost(a) -> dict:
    import jax
    import numpy as np

    from metrale_jax import LLM, LLMEngine, SamplingParams, random_model
    from metrale_jax.engine import spec_decode
    from metrale_jax.engine.bench import profile_calls, shape_config
    from metrale_jax.engine.config import EngineConfig, default_kernels

    on_gpu = jax.devices()[0].platform == "gpu"
    dtype = a.dtype or ("bfloat16" if on_gpu else "float32")
    mtp = a.method == "mtp"  # the model's MTP head drafts (Qwen3-Next shapes): random weights, so rarely right
    model, params = random_model(shape_config(a.shape, a.num_layers), dtype=dtype, repeat_layers=True,
                                 split_layers=on_gpu, mtp=mtp)
    plain_params = {n: p for n, p in params.items() if n != "mtp"}
    batches = [int(b) for b in a.batches.split(",")]
    k = a.k
    mml = a.prompt_len + (k + 1) * (a.steps + 2) + 16
    # two engines in one process: each its own KV pool of just enough blocks (sized from free
    # memory, the second one found none: H200, 2026-12-02)
    cfg = EngineConfig(dtype=dtype, max_model_len=mml, max_num_seqs=max(batches), decode_buckets=tuple(batches),
                       show_progress=False, num_kv_blocks=max(batches) * -(-mml // 16) + 16)
    kernels = json.loads(a.attention)
    if kernels:  # AttentionConfig fields over the device's default kernels
        base = default_kernels(on_gpu, getattr(model, "has_experts", False))
        cfg = cfg.replace(attention=dataclasses.replace(base, **kernels))
    engines = {"plain": LLM.from_engine(LLMEngine(model, plain_params, cfg)),
               "spec": LLM.from_engine(LLMEngine(model, params, cfg.replace(
                   speculative_config={"method": a.method, "num_speculative_tokens": k})))}
    rng = np.random.default_rng(0)
    res = {"shape": a.shape, "num_layers": a.num_layers, "dtype": dtype, "k": k, "method": a.method,
           "attention": kernels,
           "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": []}
    real_propose, real_ahead = spec_decode.draft_tokens, spec_decode.draft_past_inflight
    v = model.cfg.vocab_size

    def full(seq, kk, spec):  # always kk drafts (cost only: mostly rejected)
        return [int(seq.token_ids[-1])] * kk

    def full_ahead(seq, inflight, kk, spec):  # the same for rows whose last step is in flight
        return full(seq, kk, spec)

    for b in batches:
        prompts = [{"prompt_token_ids": rng.integers(3, v - 1, a.prompt_len).tolist()} for _ in range(b)]

        def wall(llm, n, prompts=prompts):
            best, steps = 1e9, 0
            for _ in range(a.repeats):
                s0 = llm.stats().num_steps
                t = time.perf_counter()
                llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
                dt = time.perf_counter() - t
                if dt < best:
                    best, steps = dt, llm.stats().num_steps - s0
            return best, steps

        run = {"batch": b}
        w1, s1 = wall(engines["plain"], 1)
        wn, sn = wall(engines["plain"], 1 + a.steps)
        run["decode_step_ms"] = 1e3 * (wn - w1) / max(sn - s1, 1)
        spec_decode.draft_tokens, spec_decode.draft_past_inflight = full, full_ahead
        try:
            w1, s1 = wall(engines["spec"], 2)
            wn, sn = wall(engines["spec"], 2 + a.steps)
            if a.profile:  # verify steps alone, once every row decodes (host events, the GPU's idle gaps)
                eng = engines["spec"].llm_engine
                sp = SamplingParams(temperature=0, max_tokens=4 + a.steps, ignore_eos=True)
                for i, pr in enumerate(prompts):
                    eng.add_request(f"profile{b}_{i}", pr, sp)
                while eng.scheduler.waiting or any(not s.decoding for s in eng.scheduler.running):
                    eng.step()
                for _ in range(2):
                    eng.step()
                profile_calls(eng.step, Path(a.profile) / f"{a.method}_b{b}", a.steps)
                while eng.has_unfinished_requests():
                    eng.step()
        finally:
            spec_decode.draft_tokens, spec_decode.draft_past_inflight = real_propose, real_ahead
        run["verify_step_ms"] = 1e3 * (wn - w1) / max(sn - s1, 1)
        run["verify_over_decode"] = run["verify_step_ms"] / run["decode_step_ms"]
        # end to end with the real n-gram drafter: on the random weights, then made to loop (`_looping`)
        n = 1 + (k + 1) * a.steps
        for tag, params_of in (("", None), ("loop_", _looping)) if not mtp else (("", None),):
            for name in ("plain", "spec"):
                tok_s, st = _e2e(engines[name], prompts, n, a.repeats, params_of)
                run[f"e2e_{tag}{name}_tok_s"] = tok_s
                if name == "spec":
                    run[f"e2e_{tag}accepted_per_verify_row"] = st[2] / max(st[0], 1)
                    run[f"e2e_{tag}spec_draft_tokens"], run[f"e2e_{tag}spec_accepted_tokens"] = st[1], st[2]
            run[f"e2e_{tag}speedup"] = run[f"e2e_{tag}spec_tok_s"] / run[f"e2e_{tag}plain_tok_s"]
        res["runs"].append(run)
        print(json.dumps(run), flush=True)
    return res


def host(a) -> dict:
    import jax
    import numpy as np

    from metrale_jax.engine import spec_decode
    from metrale_jax.engine.spec_decode import SpeculativeConfig
    from metrale_jax.engine.testing import fake_engine, fake_next_token
    from metrale_jax.sampling import RequestOutputKind, SamplingParams

    batch, mt = a.host_batch, a.max_tokens
    runs = {}
    real, real_ahead = spec_decode.draft_tokens, spec_decode.draft_past_inflight
    cases = (("plain (one step ahead)", None),
             ("spec k=4, 8-gram lookup: few drafts (steps overlap unless a lookup matches)",
              SpeculativeConfig("ngram", 4, 8, 8)),
             ("spec k=4, oracle drafts always right", SpeculativeConfig("ngram", 4)))
    for name, spec in cases:
        eng = fake_engine(use_ssm=False, max_model_len=512, num_kv_blocks=max(batch, 4) * 40, max_num_seqs=batch,
                          max_num_batched_tokens=2048, decode_buckets=(batch,), mixed_decode_buckets=(batch,),
                          prefill_buckets=(2048,), max_prefill_streams=4, speculative_config=spec)
        w = np.asarray(eng.params["w"])
        if "oracle" in name:
            def continuation(ids, k, w=w):
                ids, out = list(ids), []
                for _ in range(k):
                    out.append(fake_next_token(w, ids))
                    ids.append(out[-1])
                return out

            def oracle(seq, k, spec):
                return continuation(seq.token_ids, k)

            def oracle_ahead(seq, inflight, k, spec):  # past the step in flight (overlapped verify steps)
                return spec_decode.drafts_after(continuation(seq.token_ids, len(inflight) + 1 + k), inflight, k)
            spec_decode.draft_tokens, spec_decode.draft_past_inflight = oracle, oracle_ahead
        rng = np.random.default_rng(0)
        sp = SamplingParams(temperature=0, max_tokens=mt, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
        for i in range(batch):
            eng.add_request(f"r{i}", {"prompt_token_ids": rng.integers(3, 60, 32).tolist()}, sp)
        for _ in range(3):
            eng.step()
        times, n0 = [], eng.stats().generation_tokens_total
        t0 = time.perf_counter()
        try:
            while eng.has_unfinished_requests():
                t = time.perf_counter()
                eng.step()
                times.append(time.perf_counter() - t)
        finally:
            spec_decode.draft_tokens, spec_decode.draft_past_inflight = real, real_ahead
        dt = time.perf_counter() - t0
        st = eng.stats()
        runs[name] = dict(median_step_ms=1e3 * float(np.median(times)), steps=len(times),
                          tokens_per_s=(st.generation_tokens_total - n0) / dt, spec_draft_tokens=st.spec_draft_tokens,
                          spec_accepted_tokens=st.spec_accepted_tokens)
        print(name, json.dumps(runs[name]), flush=True)
    return dict(what=f"host loop per step, FakeModel (negligible device work), batch {batch}, greedy, FINAL_ONLY "
                     "(the oracle's own Python lookups are in the third case's time)",
                device=jax.devices()[0].platform, jax=jax.__version__,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), runs=runs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["acceptance", "cost", "host"])
    p.add_argument("--host-batch", type=int, default=64)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--method", default="ngram", choices=["ngram", "mtp"], help="cost: the drafter (mtp: Qwen3-Next)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", default=None)
    p.add_argument("--attention", default="{}", help="cost: JSON of AttentionConfig fields over the device's default")
    p.add_argument("--profile", metavar="DIR", default=None, help="cost: profile one generate of the verify steps")
    a = p.parse_args()
    res = {"acceptance": acceptance, "cost": cost, "host": host}[a.what](a)
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
