"""Throughput / latency benchmark (`metrale bench`, `bench/throughput.py`).

Measures, in one run:
* offline throughput: `--num-requests` requests with fixed-seed random prompt and output lengths
  (ignore_eos, so the lengths hold), run to completion;
* decode step latency at each `--batches` size with `--context` tokens of context: the engine's
  `step()` (host scheduling + metadata + device) and the device alone (the executable looped);
* the roofline ratio of each decode step: bytes it must read (weights + live KV) divided by a
  device memcpy measured in the same run (torch `copy_` on GPU when torch imports, numpy on
  CPU), over the measured step time;
* peak memory and the KV pool size;
* start-up and compile time, cold (empty compilation cache) and warm, with the time to first
  token, each in a fresh subprocess (`--startup`);
* optionally (`--compare-transformers PYTHON`) transformers' `generate` on the same workload, run
  as a subprocess with another interpreter (the Python 3.11 fixture venv on the dev machine).

`--random-weights --shape NAME` builds a model of that shape with random weights (for the GPU
machine, where checkpoints cannot be carried): dense `llama3-8b`, `smollm2-135m`, and the hybrids
`qwen3-next-80b-a3b` (Gated DeltaNet + gated attention, 512-expert MoE) and `nemotron-h-8b`
(Mamba-2 + attention + relu² MLP). `--num-layers N` keeps the widths and cuts the depth to fit
the device (the layer pattern stays the family's; see `shape_config`). The roofline bytes of a
decode step are `decode_bytes`: weights (touched MoE experts only, B embedding rows), live KV,
and the recurrent state read and written.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

SHAPES = {
    "llama3-8b": dict(
        architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False, bos_token_id=128000,
        eos_token_id=128001,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
    ),
    "smollm2-135m": dict(
        architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2,
    ),
    # Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (the layer pattern comes from
    # full_attention_interval: 3 Gated DeltaNet layers, then one gated attention layer)
    "qwen3-next-80b-a3b": dict(
        architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=151936, hidden_size=2048,
        intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, decoder_sparse_step=1, mlp_only_layers=[], full_attention_interval=4,
        norm_topk_prob=True, partial_rotary_factor=0.25, rope_theta=10000000.0, rms_norm_eps=1e-6,
        hidden_act="silu", attention_bias=False, max_position_embeddings=262144, tie_word_embeddings=False,
        bos_token_id=151643, eos_token_id=151645,
    ),
    # nvidia/Nemotron-H-8B-Base-8K shapes: 24 Mamba-2, 24 relu² MLP and 4 attention layers
    "nemotron-h-8b": dict(
        architectures=["NemotronHForCausalLM"], model_type="nemotron_h", vocab_size=131072, hidden_size=4096,
        num_hidden_layers=52, hybrid_override_pattern="M-M-M-M-M-M*-" * 4, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, attention_head_dim=128, mamba_num_heads=128, mamba_head_dim=64,
        ssm_state_size=128, n_groups=8, conv_kernel=4, expand=2, chunk_size=128, use_conv_bias=True,
        use_bias=False, mamba_proj_bias=False, mamba_hidden_act="silu", intermediate_size=21504,
        mlp_hidden_act="relu2", hidden_act="relu2", mlp_bias=False, attention_bias=False,
        time_step_min=0.001, time_step_max=0.1, time_step_floor=1e-4, residual_in_fp32=False,
        rescale_prenorm_residual=True, layer_norm_epsilon=1e-5, rms_norm_eps=1e-5, max_position_embeddings=8192,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
    # Qwen/Qwen3-30B-A3B's config.json: 48 all-MoE layers (128 experts, top-8, norm_topk_prob), q/k norm
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True, rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu", attention_bias=False,
        max_position_embeddings=40960, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645,
    ),
    # state-spaces/mamba2-2.7b in transformers' Mamba2Config names: d_model 2560, 64 layers, expand 2
    # (80 heads x 64), d_state 128, one group, vocab 50277 padded to 50288, tied embeddings
    "mamba2-2.7b": dict(
        architectures=["Mamba2ForCausalLM"], model_type="mamba2", vocab_size=50288, hidden_size=2560,
        num_hidden_layers=64, expand=2, num_heads=80, head_dim=64, state_size=128, n_groups=1, conv_kernel=4,
        chunk_size=256, use_conv_bias=True, use_bias=False, hidden_act="silu", layer_norm_epsilon=1e-5,
        residual_in_fp32=True, rms_norm=True, time_step_min=0.001, time_step_max=0.1, time_step_floor=1e-4,
        time_step_limit=[0.0, float("inf")], tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
        pad_token_id=0,
    ),
}


def shape_config(name: str, num_layers: int | None = None) -> dict:
    """The config.json dict of `SHAPES[name]`, with `num_layers` layers when given.

    Layer patterns follow the family: an interval pattern (Qwen3-Next: attention every
    `full_attention_interval`-th layer) is rewritten for the new depth; an explicit pattern
    (Nemotron-H's `hybrid_override_pattern`) keeps its first `num_layers` codes. A hybrid cut so
    short that it keeps no attention layer is refused.
    """
    cfg = copy.deepcopy(SHAPES[name])
    if num_layers is None:
        return cfg
    if num_layers < 1:
        raise ValueError(f"--num-layers {num_layers} must be >= 1")
    if "hybrid_override_pattern" in cfg:
        full = cfg["hybrid_override_pattern"]
        pattern = full[:num_layers]
        if num_layers > len(full):
            raise ValueError(f"--num-layers {num_layers}: shape {name} has a {len(full)}-layer pattern {full!r}; "
                             f"it can be cut, not grown")
        if "*" not in pattern:
            raise ValueError(f"--num-layers {num_layers}: the first {num_layers} layers of {name} ({pattern!r}) "
                             f"hold no attention layer; the first is layer {full.find('*') + 1} of {full!r}")
        cfg["hybrid_override_pattern"] = pattern
    elif "full_attention_interval" in cfg:
        k = cfg["full_attention_interval"]
        if num_layers < k:
            raise ValueError(f"--num-layers {num_layers}: shape {name} puts its first attention layer at layer {k} "
                             f"(full_attention_interval={k}); use at least {k} layers")
        cfg["layer_types"] = ["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(num_layers)]
    cfg["num_hidden_layers"] = num_layers
    return cfg


def add_args(p: argparse.ArgumentParser) -> None:
    from metrale_jax.loading.hub import DEFAULT_MODEL

    p.add_argument("--model", "-m", default=DEFAULT_MODEL, help="checkpoint path or alias")
    p.add_argument("--random-weights", action="store_true", help="random weights of --shape (no checkpoint)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    p.add_argument("--num-layers", type=int, default=None,
                   help="with --random-weights: this many layers of --shape (the same widths), to fit the device")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--num-requests", type=int, default=None, help="offline requests (default 256 GPU / 16 CPU)")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    p.add_argument("--batches", default="1,8,64", help="decode latency batch sizes")
    p.add_argument("--context", type=int, default=128, help="context length of the decode latency rows")
    p.add_argument("--decode-steps", type=int, default=16, help="timed decode steps per batch size")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: the largest of --batches")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prefill-buckets", default="", help="comma list of prefill T buckets (default: the engine's)")
    p.add_argument("--mixed-decode-buckets", default="", help="comma list of mixed-step N buckets")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--quantization", choices=["fp8", "int4", "nvfp4"], default=None,
                   help="quantize the linear weights at load")
    p.add_argument("--pallas", action=argparse.BooleanOptionalAction, default=None,
                   help="force the Pallas kernels on or off (default: on for GPU, off for CPU)")
    p.add_argument("--unroll-layers", action=argparse.BooleanOptionalAction, default=None,
                   help="walk the layers in a Python loop, not lax.scan (default: on for GPU, off for CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--skip-latency", action="store_true")
    p.add_argument("--startup", action="store_true", help="also time cold and warm start-up in subprocesses")
    p.add_argument("--compare-transformers", metavar="PYTHON", default=None,
                   help="run transformers' generate on the same workload with this interpreter (CPU peer)")
    p.add_argument("--hf-batch", type=int, default=8, help="transformers peer: batch size")
    p.add_argument("--out", default=None, help="write results JSON here (a .md summary next to it)")
    p.add_argument("--profile", metavar="DIR", default=None,
                   help="write each decode executable's HLO, cost analysis and per-kernel times here")
    p.add_argument("--startup-probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)


# ---- helpers -------------------------------------------------------------------------------------
def _on_gpu() -> bool:
    import jax

    return jax.devices()[0].platform == "gpu"


def memcpy_bandwidth(nbytes: int = 1 << 30) -> tuple[float, str]:
    """Device copy bandwidth in bytes/s (read + write counted): torch copy_ on GPU, numpy on CPU."""
    if _on_gpu():
        try:
            import torch

            n = nbytes // 2
            a = torch.empty(n, dtype=torch.bfloat16, device="cuda")
            b = torch.empty_like(a)
            for _ in range(3):
                b.copy_(a)
            torch.cuda.synchronize()
            reps = 20
            t0 = time.perf_counter()
            for _ in range(reps):
                b.copy_(a)
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) / reps
            del a, b
            torch.cuda.empty_cache()
            return 2 * nbytes / dt, "torch copy_"
        except Exception as e:  # noqa: BLE001 - fall back to a JAX copy
            log.warning("torch memcpy unavailable (%s); using a jax copy (an underestimate)", e)
            import jax
            import jax.numpy as jnp

            x = jnp.zeros(nbytes // 2, jnp.bfloat16)
            f = jax.jit(lambda x: x + 1)
            f(x).block_until_ready()
            t0 = time.perf_counter()
            for _ in range(10):
                y = f(x)
            y.block_until_ready()
            return 2 * nbytes / ((time.perf_counter() - t0) / 10), "jax x+1"
    n = min(nbytes, 1 << 28)
    a = np.ones(n, np.uint8)
    b = np.empty_like(a)
    np.copyto(b, a)
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return 2 * n / best, "numpy copyto"


def peak_memory() -> dict:
    out = {"host_max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    try:
        import jax

        st = jax.devices()[0].memory_stats() or {}
        if "peak_bytes_in_use" in st:
            out["device_peak_mb"] = st["peak_bytes_in_use"] / 1e6
            out["device_limit_mb"] = st.get("bytes_limit", 0) / 1e6
    except Exception:  # noqa: BLE001
        pass
    return out


def _load(args):
    from metrale_jax.model import load_model, random_model

    t0 = time.perf_counter()
    if args.num_layers is not None and not args.random_weights:
        raise SystemExit("--num-layers needs --random-weights (it reshapes --shape)")
    if args.random_weights:
        dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if _on_gpu() else "float32")
        config = shape_config(args.shape, args.num_layers)
        from metrale_jax.cli import kernels_from_args

        kernels = kernels_from_args(args)  # per-layer arrays when the engine will walk the layers in Python
        split = kernels.unroll_layers if kernels is not None else _on_gpu()
        model, params = random_model(config, dtype=dtype, seed=args.seed, repeat_layers=True, split_layers=split,
                                     quantization=args.quantization)
        name = f"random-{args.shape}" + (f"-{args.num_layers}l" if args.num_layers is not None else "")
    else:
        model, params = load_model(args.model, dtype=args.dtype, show_progress=False, quantization=args.quantization)
        name = str(args.model)
    if args.quantization:
        name += f" ({args.quantization} weights)"
    import jax

    jax.block_until_ready(params)
    return model, params, name, time.perf_counter() - t0


def _engine_config(args, batches):
    from metrale_jax.cli import kernels_from_args
    from metrale_jax.engine.config import DEFAULT_CACHE_DIR, EngineConfig

    seqs = args.max_num_seqs or max(batches)
    budget = args.max_num_batched_tokens or max(seqs, 2048 if _on_gpu() else 256)
    return EngineConfig(
        model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=seqs, max_num_batched_tokens=budget,
        decode_buckets=tuple(sorted(set(batches) | {seqs})),
        prefill_buckets=tuple(int(x) for x in args.prefill_buckets.split(",") if x),
        mixed_decode_buckets=tuple(int(x) for x in args.mixed_decode_buckets.split(",") if x),
        attention=kernels_from_args(args),
        compilation_cache_dir=args.cache_dir or DEFAULT_CACHE_DIR, seed=args.seed,
        cpu_kv_tokens=max(8192, seqs * (args.context + args.decode_steps + 16) + 1024),
        show_progress=not args.startup_probe,
    )


def _workload(args, vocab: int, n: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(args.seed)
    out = []
    for _ in range(n):
        p = int(rng.integers(args.prompt_len[0], args.prompt_len[1] + 1))
        o = int(rng.integers(args.output_len[0], args.output_len[1] + 1))
        out.append((rng.integers(3, vocab - 1, p).tolist(), o))
    return out


def weight_bytes(params) -> int:
    import jax

    return int(sum(x.nbytes for x in jax.tree.leaves(params)))


def _routing(cfg) -> tuple[int, int]:
    """(routed experts E, experts per token k) of a MoE config; (0, 0) without experts."""
    e = int(cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0)
    return (e, int(cfg.get("num_experts_per_tok"))) if e else (0, 0)


def decode_bytes(model, params, batch: int, context: int, kv_dtype=None) -> dict:
    """Bytes a decode step of `batch` rows, each with `context` tokens of context, must move.

    weights: every parameter once, except
      * routed MoE experts (leaves named `experts_*`, the expert axis second): only the experts the
        batch touches, in expectation E (1 - (1 - k/E)^B) of E per layer (k experts per token,
        uniform routing; exactly k at B = 1), times the bytes of one expert;
      * the input embedding table: only the B rows looked up, when the LM head is a separate
        matrix (read whole). Tied embeddings are read whole by the LM head.
      For dense models this is the earlier count (every parameter byte) less the (V - B) embedding
      rows a step never reads: the only change to their roofline.
    kv: the live K and V of the attention layers, B * context tokens (recurrent layers have none).
    ssm: every row's recurrent state (conv + SSM / delta-rule, float32) of every Mamba-2 / GDN
      layer, read and written once: 2 * B * the engine's SSM pool bytes per slot.
    -> dict(weights, kv, ssm, total, weights_all, experts_all, experts_touched, experts_per_layer)
    `params` may hold `jax.ShapeDtypeStruct`s (only shapes and dtypes are read).
    """
    import jax

    from metrale_jax.layers.stack import Unstacked

    params = jax.tree.map(  # per-layer parts (split_layers) count as their stacked array
        lambda a: jax.ShapeDtypeStruct((len(a),) + a.parts[0].shape, a.parts[0].dtype)
        if isinstance(a, Unstacked) else a, params, is_leaf=lambda a: isinstance(a, Unstacked))
    cfg = model.cfg
    e, k = _routing(cfg)
    frac, per_layer = 1.0, float(e)
    if e:
        per_layer = e * (1.0 - (1.0 - k / e) ** batch)
        frac = per_layer / e
    tied = "lm_head" not in params
    total = every = experts_all = experts = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = [str(getattr(p, "key", getattr(p, "name", ""))) for p in path]
        n = int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
        every += n
        total += n
        if e and any(x.startswith("experts_") for x in names):
            if leaf.ndim < 2 or leaf.shape[1] != e:
                raise ValueError(f"expert weights {'/'.join(names)} {leaf.shape}: the expert axis ({e}) "
                                 f"should be the second")
            experts_all += n
            experts += n * frac
        elif names == ["embed"] and not tied:
            total -= n - n // leaf.shape[0] * min(batch, leaf.shape[0])
    weights = int(round(total - experts_all + experts))
    kv = batch * context * model.kv_bytes_per_block(1, kv_dtype)
    ssm = 2 * batch * model.ssm_bytes_per_slot()
    return dict(weights=weights, kv=int(kv), ssm=int(ssm), total=int(weights + kv + ssm),
                weights_all=every, experts_all=experts_all, experts_touched=int(round(experts)),
                experts_per_layer=per_layer if e else 0.0)


# ---- measurements --------------------------------------------------------------------------------
def measure_throughput(eng, args, n: int) -> dict:
    from metrale_jax.sampling import SamplingParams

    work = _workload(args, eng.vocab_size, n)
    for i, (p, o) in enumerate(work):
        eng.add_request(f"tp{i}", {"prompt_token_ids": p},
                        SamplingParams(temperature=0.8, seed=i, max_tokens=o, ignore_eos=True))
    t0 = time.perf_counter()
    first = None
    steps = 0
    while eng.has_unfinished_requests():
        outs = eng.step()
        steps += 1
        if first is None and outs:
            first = time.perf_counter() - t0
    dt = time.perf_counter() - t0
    pin = sum(len(p) for p, _ in work)
    pout = sum(o for _, o in work)
    return dict(num_requests=n, prompt_tokens=pin, output_tokens=pout, seconds=dt, steps=steps,
                output_tok_per_s=pout / dt, total_tok_per_s=(pin + pout) / dt, first_output_s=first,
                prompt_len=list(args.prompt_len), output_len=list(args.output_len))


def measure_decode_latency(eng, args, batch: int, bw: float, sampling=None) -> dict:
    """Fill `batch` rows with `args.context` tokens of context, then time pure decode steps
    (the device alone: rows sampled as `sampling`, a `RowSampling`; greedy by default)."""
    import jax

    from metrale_jax.metadata_builder import DecodeRow, RowSampling, build_step
    from metrale_jax.sampling import SamplingParams

    rng = np.random.default_rng(args.seed + batch)
    steps = args.decode_steps
    # rows that finish their prefill early decode while the others prefill: let them run long
    sp = SamplingParams(temperature=0, max_tokens=max(eng.config.max_model_len - args.context - 1, 1),
                        ignore_eos=True)
    rids = [f"lat{batch}-{i}" for i in range(batch)]
    for r in rids:
        eng.add_request(r, {"prompt_token_ids": rng.integers(3, eng.vocab_size - 1, args.context).tolist()}, sp)
    # prefill until every row decodes
    while any(not s.decoding or s.status.value != "running" for r in rids for s in eng.requests[r].seqs):
        eng.step()
    eng.step()  # one warm decode
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    engine_dt = (time.perf_counter() - t0) / steps
    # the device alone: the same decode executable, inputs fixed, state fed back
    seqs = [eng.requests[r].seqs[0] for r in rids]
    # (re-)decode each row's last cached token: its block exists, unlike the next position's
    rows = [DecodeRow(token=s.token_ids[s.num_computed - 1], position=s.num_computed - 1, block_table=s.blocks,
                      sampling=sampling or RowSampling()) for s in seqs]
    inputs = build_step(eng.builder, eng.compiler.bucket_for(len(rows), 0, 0), rows, [])
    bucket = inputs.bucket
    dev = eng.compiler.transfer(inputs)
    state = eng.state
    for _ in range(2):
        state, out, _ = eng.compiler.run(bucket, eng.params, state, dev)
    jax.block_until_ready(out.token_ids)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, out, _ = eng.compiler.run(bucket, eng.params, state, dev)
    dispatch_dt = (time.perf_counter() - t0) / steps  # host time to launch (the device runs behind)
    jax.block_until_ready(out.token_ids)
    device_dt = (time.perf_counter() - t0) / steps
    if args.profile:
        state = profile_executable(eng.compiler.executable_of(bucket),
                                   lambda st: eng.compiler.run(bucket, eng.params, st, dev)[0], state,
                                   Path(args.profile) / f"decode_b{batch}", steps)
    eng.state = state
    ctx = args.context + steps
    need = decode_bytes(eng.model, eng.params, batch, ctx, eng.kv_dtype)
    for r in rids:
        eng.abort(r)
    ideal = need["total"] / bw
    return dict(batch=batch, bucket=bucket.num_seqs, context=ctx, engine_step_ms=engine_dt * 1e3,
                device_step_ms=device_dt * 1e3, dispatch_ms=dispatch_dt * 1e3,
                tok_per_s=batch / engine_dt, device_tok_per_s=batch / device_dt,
                bytes_per_step=need["total"], bytes_weights=need["weights"], bytes_kv=need["kv"],
                bytes_ssm=need["ssm"], experts_per_layer=need["experts_per_layer"], roofline_step_ms=ideal * 1e3,
                roofline_ratio_engine=ideal / engine_dt, roofline_ratio_device=ideal / device_dt)


def profile_executable(exe, run_once, state, out: Path, steps: int):
    """Write `exe`'s optimized HLO and cost analysis under `out`, then run `run_once(state) -> state`
    `steps` times under the JAX profiler and write the device kernels' total time by name
    (`kernels.txt`, largest first). Returns the state (the step donates it)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "hlo.txt").write_text(exe.as_text())
    try:
        (out / "cost.json").write_text(json.dumps(exe.cost_analysis(), indent=1, default=str))
    except Exception as e:  # noqa: BLE001 - not every backend reports it
        log.warning("cost analysis unavailable: %s", e)
    box = [state]

    def run():
        box[0] = run_once(box[0])
        return box[0]

    profile_calls(run, out, steps)
    return box[0]


def profile_calls(run, out: Path, steps: int, *, python_tracer: bool = True, extra=None) -> None:
    """Call `run()` `steps` times under the JAX profiler and write the device kernels' total time
    per call by name, the GPU's idle gaps and the host's largest events (`out/kernels.txt`).
    python_tracer False: no event per Python call (the host runs at its own speed); `extra(events,
    procs) -> lines` adds lines of its own analysis of the trace's events."""
    import gzip

    import jax

    out.mkdir(parents=True, exist_ok=True)
    trace_dir = out / "trace"
    opts = jax.profiler.ProfileOptions()
    opts.python_tracer_level = 1 if python_tracer else 0
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True, profiler_options=opts):
        for _ in range(steps):
            r = run()
        jax.block_until_ready(r)
    files = sorted(trace_dir.rglob("perfetto_trace.json.gz"))
    if not files:
        log.warning("no perfetto trace written under %s", trace_dir)
        return
    events = json.loads(gzip.open(files[-1]).read())
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    tot: dict[str, list[float]] = {}
    for e in events:
        if _on_gpu_trace(e, procs):
            t = tot.setdefault(e["name"], [0.0, 0])
            t[0] += e["dur"] / steps
            t[1] += 1 / steps
    rows = sorted(tot.items(), key=lambda kv: -kv[1][0])
    total = sum(v[0] for _, v in rows)
    lines = [f"device kernels per step: {total:.1f} us in {sum(v[1] for _, v in rows):.0f} launches "
             f"(processes: {sorted(set(procs.values()))})"]
    lines += _timeline_lines(events, procs, steps)
    lines += extra(events, procs) if extra is not None else []
    lines += [f"{v[0]:10.1f} us {v[1]:6.1f}x  {k[:160]}" for k, v in rows[:80]]
    (out / "kernels.txt").write_text("\n".join(lines) + "\n")
    shutil.rmtree(trace_dir, ignore_errors=True)  # tens of MB; the summary is what we keep
    log.info("profile %s:\n%s", out, "\n".join(lines[:50]))


def _on_gpu_trace(e: dict, procs: dict) -> bool:
    """A complete event (kernel, copy) of a GPU's process in a perfetto trace."""
    return e.get("ph") == "X" and "GPU" in procs.get(e.get("pid"), "") and "dur" in e


def gpu_gaps(events, procs, min_gap_us: float = 0.0) -> list[tuple[float, float, str, str]]:
    """The GPUs' idle intervals (all streams merged) of more than `min_gap_us` in a perfetto
    trace's events: (start us, end us, the kernel before, the kernel after)."""
    gpu = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if _on_gpu_trace(e, procs))
    if not gpu:
        return []
    gaps, end, prev = [], gpu[0][1], gpu[0][2]
    for t0, t1, name in gpu[1:]:
        if t0 - end > min_gap_us:
            gaps.append((end, t0, prev, name))
        if t1 > end:
            end, prev = t1, name
    return gaps


def _timeline_lines(events, procs, steps: int) -> list[str]:
    """Where a step's wall time goes besides kernels: the GPU's idle gaps between consecutive
    kernels (all streams merged), bucketed by length, with the kernels around the largest ones,
    and the host-side events that take the most time per step."""
    gpu = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if _on_gpu_trace(e, procs))
    if len(gpu) < 2:
        return []
    gaps = [(t1 - t0, a, b) for t0, t1, a, b in gpu_gaps(events, procs)]
    span = (gpu[-1][1] - gpu[0][0]) / steps
    buckets = [(0, 2), (2, 5), (5, 10), (10, 50), (50, 1e12)]
    out = [f"GPU span per step {span:.1f} us (first kernel start to last kernel end over {steps} steps); "
           f"idle gaps per step: {sum(g for g, _, _ in gaps) / steps:.1f} us in {len(gaps) / steps:.0f} gaps"]
    for lo, hi in buckets:
        sel = [g for g, _, _ in gaps if lo <= g < hi]
        out.append(f"  gaps {lo}-{hi if hi < 1e12 else 'inf'} us: {len(sel) / steps:.1f} per step, "
                   f"{sum(sel) / steps:.1f} us")
    for g, a, b in sorted(gaps, reverse=True)[:8]:
        out.append(f"  gap {g:.1f} us after {a[:60]} before {b[:60]}")
    pairs: dict[tuple[str, str], list[float]] = {}  # where the short gaps are: kernel pairs by total gap
    for g, a, b in gaps:
        if g < 5:
            pairs.setdefault((a[:50], b[:50]), []).append(g)
    for (a, b), gs in sorted(pairs.items(), key=lambda kv: -sum(kv[1]))[:10]:
        out.append(f"  short gaps {sum(gs) / steps:6.1f} us ({len(gs) / steps:5.1f} per step) after {a} before {b}")
    host: dict[str, float] = {}
    for e in events:
        if e.get("ph") == "X" and "GPU" not in procs.get(e.get("pid"), "") and "dur" in e:
            host[e["name"]] = host.get(e["name"], 0.0) + e["dur"] / steps
    out.append("host events, us per step (largest):")
    out += [f"  {v:10.1f}  {k[:120]}" for k, v in sorted(host.items(), key=lambda kv: -kv[1])[:30]]
    return out


def _startup_probe(args) -> int:
    """Child process: load, build the engine, time the first token; print one JSON line."""
    from metrale_jax.sampling import SamplingParams

    t0 = time.perf_counter()
    model, params, name, load_s = _load(args)
    from metrale_jax.engine.engine import LLMEngine

    batches = [int(b) for b in args.batches.split(",")]
    eng = LLMEngine(model, params, _engine_config(args, batches))
    ready = time.perf_counter() - t0
    eng.add_request("probe", {"prompt_token_ids": list(range(5, 5 + args.context))},
                    SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    t1 = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
    ttft = time.perf_counter() - t1
    print("STARTUP " + json.dumps(dict(load_s=load_s, compile_s=eng.compiler.compile_seconds,
                                       executables=eng.compiler.num_executables, ready_s=ready,
                                       first_token_after_ready_s=ttft, time_to_first_token_s=ready + ttft)))
    return 0


def measure_startup(args) -> dict:
    """Cold (empty compilation cache) and warm start-up, each in a fresh process."""
    out = {}
    argv = ["--model", str(args.model), "--shape", args.shape, "--dtype", args.dtype, "--batches", args.batches,
            "--context", str(args.context), "--max-model-len", str(args.max_model_len), "--block-size",
            str(args.block_size), "--seed", str(args.seed), "--gpu-memory-utilization",
            str(args.gpu_memory_utilization), "--prefill-buckets", args.prefill_buckets,
            "--mixed-decode-buckets", args.mixed_decode_buckets]
    for flag, v in (("--max-num-seqs", args.max_num_seqs), ("--num-kv-blocks", args.num_kv_blocks),
                    ("--max-num-batched-tokens", args.max_num_batched_tokens), ("--num-layers", args.num_layers)):
        if v is not None:
            argv += [flag, str(v)]
    argv += ["--random-weights"] * args.random_weights
    argv += ["--quantization", args.quantization] if args.quantization else []
    if args.pallas is not None:
        argv += ["--pallas" if args.pallas else "--no-pallas"]
    if args.unroll_layers is not None:
        argv += ["--unroll-layers" if args.unroll_layers else "--no-unroll-layers"]
    with tempfile.TemporaryDirectory() as cache:
        for label in ("cold", "warm"):
            cmd = [sys.executable, "-m", "metrale_jax.engine.bench", *argv, "--startup-probe", "--cache-dir", cache,
                   "--skip-throughput", "--skip-latency"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = [x for x in proc.stdout.splitlines() if x.startswith("STARTUP ")]
            if proc.returncode != 0 or not line:
                out[label] = {"error": proc.stderr[-2000:]}
            else:
                out[label] = json.loads(line[-1][8:])
    return out


_HF_SCRIPT = r"""
import json, sys, time
import torch
from transformers import AutoModelForCausalLM
cfg = json.loads(sys.argv[1])
torch.manual_seed(0)
torch.set_num_threads(cfg["threads"])
t0 = time.perf_counter()
if cfg["gguf"]:
    import os
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(cfg["gguf"]), gguf_file=os.path.basename(cfg["gguf"]),
                                                 torch_dtype=torch.float32)
else:
    model = AutoModelForCausalLM.from_pretrained(cfg["path"], torch_dtype=torch.float32)
model.eval()
load_s = time.perf_counter() - t0
res = {"load_s": load_s, "runs": []}
for batch in cfg["batches"]:
    prompts = cfg["prompts"][:batch]
    L = max(len(p) for p in prompts)
    pad = cfg["pad"]
    ids = torch.tensor([[pad] * (L - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    n_new = cfg["new_tokens"]
    with torch.inference_mode():
        model.generate(ids[:, -8:], attention_mask=mask[:, -8:], max_new_tokens=2, do_sample=False, pad_token_id=pad)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                             pad_token_id=pad)
        dt = time.perf_counter() - t0
    gen = (out.shape[1] - L) * len(prompts)
    res["runs"].append({"batch": batch, "prompt_len": L, "new_tokens": n_new, "seconds": dt, "tok_per_s": gen / dt})
import transformers
res["transformers"] = transformers.__version__
res["torch"] = torch.__version__
print("HF " + json.dumps(res))
"""


def measure_transformers(args, python: str, vocab: int, eos: int) -> dict:
    """transformers' greedy generate (float32, CPU) on a fixed batch, in another interpreter."""
    from metrale_jax.loading.hub import resolve_model

    path = resolve_model(args.model)
    rng = np.random.default_rng(args.seed)
    n_new = args.output_len[1]
    plen = args.prompt_len[1]
    prompts = [rng.integers(3, vocab - 1, plen).tolist() for _ in range(args.hf_batch)]
    cfg = dict(gguf=str(path) if str(path).endswith(".gguf") else None, path=str(path), prompts=prompts,
               batches=sorted({1, args.hf_batch}), new_tokens=n_new, pad=eos, threads=os.cpu_count() or 1)
    proc = subprocess.run([python, "-c", _HF_SCRIPT, json.dumps(cfg)], capture_output=True, text=True)
    line = [x for x in proc.stdout.splitlines() if x.startswith("HF ")]
    if proc.returncode != 0 or not line:
        return {"error": proc.stderr[-3000:]}
    res = json.loads(line[-1][3:])
    res["prompts"] = prompts
    return res


def measure_same_as_hf(eng, hf: dict) -> list[dict]:
    """Our engine on exactly the transformers workload (greedy, fixed lengths)."""
    from metrale_jax.sampling import SamplingParams

    out = []
    for run in hf.get("runs", []):
        prompts = hf["prompts"][: run["batch"]]
        sp = SamplingParams(temperature=0, max_tokens=run["new_tokens"], ignore_eos=True)
        for i, p in enumerate(prompts):
            eng.add_request(f"hf{run['batch']}-{i}", {"prompt_token_ids": p}, sp)
        t0 = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
        dt = time.perf_counter() - t0
        out.append({"batch": run["batch"], "seconds": dt, "tok_per_s": run["new_tokens"] * len(prompts) / dt,
                    "vs_transformers": (run["new_tokens"] * len(prompts) / dt) / run["tok_per_s"]})
    return out


# ---- main ----------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    if args.startup_probe:
        return _startup_probe(args)
    import jax

    from metrale_jax.engine.engine import LLMEngine

    batches = [int(b) for b in args.batches.split(",")]
    res: dict = dict(
        date=time.strftime("%Y-%m-%d %H:%M"), device=str(jax.devices()[0].device_kind),
        platform=jax.devices()[0].platform, jax=jax.__version__, python=platform.python_version(),
        cpus=os.cpu_count(), args={k: v for k, v in vars(args).items() if k != "func"},
    )
    bw, bw_how = memcpy_bandwidth()
    res["memcpy"] = dict(bytes_per_s=bw, method=bw_how)
    log.info("memcpy %.1f GB/s (%s)", bw / 1e9, bw_how)
    model, params, name, load_s = _load(args)
    res["model"] = name
    res["weight_bytes"] = weight_bytes(params)
    res["model_config"] = dict(architecture=model.cfg.architecture, num_layers=model.cfg.num_layers,
                               attention_layers=model.num_attention_layers, hidden_size=model.cfg.hidden_size,
                               vocab_size=model.cfg.vocab_size, experts=list(_routing(model.cfg)),
                               ssm_bytes_per_slot=model.ssm_bytes_per_slot(), dtype=model.dtype)
    t0 = time.perf_counter()
    eng = LLMEngine(model, params, _engine_config(args, batches))
    res["startup_in_process"] = dict(load_s=load_s, engine_s=time.perf_counter() - t0,
                                     compile_s=eng.compiler.compile_seconds,
                                     executables=eng.compiler.num_executables)
    res["kv_pool"] = dict(blocks=eng.num_blocks, block_size=eng.config.block_size,
                          tokens=eng.num_blocks * eng.config.block_size, dtype=str(eng.kv_dtype),
                          bytes=eng.num_blocks * model.kv_bytes_per_block(eng.config.block_size, eng.kv_dtype))
    if not args.skip_latency:
        res["decode_latency"] = []
        for b in batches:
            r = measure_decode_latency(eng, args, b, bw)
            log.info("batch %d: engine %.2f ms/step (%.0f tok/s), device %.2f ms (dispatch %.2f), roofline %.2f ms "
                     "(ratio %.2f; bytes: weights %.3f GB, KV %.3f GB, SSM %.3f GB)", b, r["engine_step_ms"],
                     r["tok_per_s"], r["device_step_ms"], r["dispatch_ms"], r["roofline_step_ms"],
                     r["roofline_ratio_device"], r["bytes_weights"] / 1e9, r["bytes_kv"] / 1e9, r["bytes_ssm"] / 1e9)
            res["decode_latency"].append(r)
    if not args.skip_throughput:
        n = args.num_requests or (256 if _on_gpu() else 16)
        res["throughput"] = measure_throughput(eng, args, n)
        log.info("offline: %d requests, %.1f output tok/s, %.1f total tok/s", n,
                 res["throughput"]["output_tok_per_s"], res["throughput"]["total_tok_per_s"])
    if args.compare_transformers:
        eos = (model.eos_token_ids or (0,))[0]
        hf = measure_transformers(args, args.compare_transformers, eng.vocab_size, eos)
        ours = measure_same_as_hf(eng, hf) if "runs" in hf else []
        hf.pop("prompts", None)
        res["transformers"] = hf
        res["ours_on_transformers_workload"] = ours
        for o in ours:
            log.info("transformers workload batch %d: ours %.1f tok/s (%.2fx transformers)", o["batch"],
                     o["tok_per_s"], o["vs_transformers"])
    res["peak_memory"] = peak_memory()
    if args.startup:
        res["startup"] = measure_startup(args)
    text = json.dumps(res, indent=2, default=str)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
        Path(args.out).with_suffix(".md").write_text(summary(res))
    print(summary(res))
    return 0


def summary(res: dict) -> str:
    lines = [f"# metrale-jax bench: {res['model']} on {res['device']} ({res['platform']}), {res['date']}", "",
             f"jax {res['jax']}, python {res['python']}, {res['cpus']} cpus; memcpy "
             f"{res['memcpy']['bytes_per_s'] / 1e9:.1f} GB/s ({res['memcpy']['method']}); weights "
             f"{res['weight_bytes'] / 1e6:.1f} MB; KV pool {res['kv_pool']['blocks']} blocks = "
             f"{res['kv_pool']['tokens']} tokens ({res['kv_pool']['bytes'] / 1e6:.1f} MB, "
             f"{res['kv_pool']['dtype']})", ""]
    s = res["startup_in_process"]
    lines.append(f"start-up (this process): load {s['load_s']:.1f}s, engine {s['engine_s']:.1f}s "
                 f"(compile {s['compile_s']:.1f}s, {s['executables']} executables)")
    for label, st in res.get("startup", {}).items():
        if "error" in st:
            lines.append(f"start-up {label}: ERROR {st['error'][-300:]}")
        else:
            lines.append(f"start-up {label}: ready {st['ready_s']:.1f}s (load {st['load_s']:.1f}s, compile "
                         f"{st['compile_s']:.1f}s), time to first token {st['time_to_first_token_s']:.1f}s")
    mc = res.get("model_config")
    if mc:
        e, k = mc["experts"]
        lines.append(f"model: {mc['architecture']}, {mc['num_layers']} layers ({mc['attention_layers']} attention), "
                     f"hidden {mc['hidden_size']}, vocab {mc['vocab_size']}"
                     + (f", {e} experts top-{k}" if e else "")
                     + (f", SSM state {mc['ssm_bytes_per_slot'] / 1e6:.2f} MB per sequence"
                        if mc["ssm_bytes_per_slot"] else "") + f", {mc['dtype']}")
    if "decode_latency" in res:
        lines += ["", "roofline bytes per step: weights (touched experts only; B embedding rows) + live KV + SSM "
                  "state read and written", "",
                  "| batch | context | engine ms/step | tok/s | device ms/step | roofline ms | ratio (device) | "
                  "weights GB | KV GB | SSM GB | experts/layer |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in res["decode_latency"]:
            lines.append(f"| {r['batch']} | {r['context']} | {r['engine_step_ms']:.2f} | {r['tok_per_s']:.1f} | "
                         f"{r['device_step_ms']:.2f} | {r['roofline_step_ms']:.3f} | "
                         f"{r['roofline_ratio_device']:.3f} | {r.get('bytes_weights', 0) / 1e9:.3f} | "
                         f"{r.get('bytes_kv', 0) / 1e9:.3f} | {r.get('bytes_ssm', 0) / 1e9:.3f} | "
                         f"{r.get('experts_per_layer', 0):.1f} |")
    if "throughput" in res:
        t = res["throughput"]
        lines += ["", f"offline throughput: {t['num_requests']} requests (prompt {t['prompt_len']}, output "
                  f"{t['output_len']}): {t['output_tok_per_s']:.1f} output tok/s, {t['total_tok_per_s']:.1f} total "
                  f"tok/s, {t['seconds']:.1f}s, {t['steps']} steps"]
    if "transformers" in res:
        hf = res["transformers"]
        if "error" in hf:
            lines.append(f"transformers: ERROR {hf['error'][-300:]}")
        else:
            lines.append(f"transformers {hf.get('transformers')} / torch {hf.get('torch')} (float32 generate):")
            for r, o in zip(hf["runs"], res.get("ours_on_transformers_workload", [])):
                lines.append(f"  batch {r['batch']}, prompt {r['prompt_len']}, {r['new_tokens']} new: transformers "
                             f"{r['tok_per_s']:.1f} tok/s, ours {o['tok_per_s']:.1f} tok/s "
                             f"({o['vs_transformers']:.2f}x)")
    pm = res.get("peak_memory", {})
    lines.append("peak memory: " + ", ".join(f"{k} {v:.0f}" for k, v in pm.items()))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench/throughput.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    args = p.parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S", level=logging.WARNING)
    logging.getLogger("metrale_jax").setLevel(logging.INFO)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
