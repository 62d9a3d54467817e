"""`metrale serve MODEL`: the command-line face of the server.

`metrale_jax/cli.py` (the main `metrale` command) calls `add_serve_subcommand(subparsers)` and
dispatches `serve` to `serve_main(args)`. `python -m metrale_jax.server MODEL ...` runs the same
command on its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import types
import typing
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

# EngineConfig fields the serve command does not expose (the model is positional; the rest are
# nested configs or set by the server itself).
_SKIP_ENGINE_FIELDS = {"model", "attention"}
# EngineConfig fields whose flags are the main CLI's own, shared with generate / chat
# (metrale_jax.cli.add_tokenizer_args)
_SHARED_ENGINE_FIELDS = {"tokenizer", "generation_config", "hf_overrides"}


def _engine_config_cls():
    from metrale_jax.engine.config import EngineConfig

    return EngineConfig


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(the non-None member of an Optional, whether None is allowed)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _optional_str(s: str) -> str | None:
    return None if s.lower() in ("", "none") else s


_SO_BACKENDS = ("auto", "guidance", "xgrammar", "outlines", "lm-format-enforcer")


def _so_backend(s: str) -> str:
    """vLLM's structured-output backend, as `--guided-decoding-backend NAME` or
    `--structured-outputs-config '{"backend": NAME}'`: accepted (llguidance serves every request)."""
    name = s
    if s.lstrip().startswith("{"):
        try:
            name = json.loads(s).get("backend", "auto")
        except (ValueError, AttributeError) as e:
            raise argparse.ArgumentTypeError(f"{s!r} is not a JSON object: {e}") from None
    if name not in _SO_BACKENDS:
        raise argparse.ArgumentTypeError(f"structured-output backend {name!r}: one of {', '.join(_SO_BACKENDS)}")
    return name


def _json_str_list(s: str) -> list[str]:
    """A JSON list of strings (vLLM's form for the CORS flags)."""
    try:
        v = json.loads(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{s!r} is not JSON: {e}") from None
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise argparse.ArgumentTypeError(f"{s!r} is not a JSON list of strings")
    return v


def _port(s: str) -> int:
    p = int(s)
    if not 0 <= p <= 65535:
        raise argparse.ArgumentTypeError(f"{s} is not a TCP port (0-65535)")
    return p


# vLLM's spellings of EngineConfig flags, accepted beside ours
_ENGINE_FLAG_ALIASES = {"kv_dtype": ("--kv-cache-dtype",)}


def _int_tuple(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip()) if s else ()


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One `--field-name` option per scalar EngineConfig field, defaulting to the config's default."""
    from metrale_jax.cli import add_tokenizer_args

    cls = _engine_config_cls()
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group("engine options (EngineConfig)")
    add_tokenizer_args(group)
    for f in dataclasses.fields(cls):
        if f.name in _SKIP_ENGINE_FIELDS | _SHARED_ENGINE_FIELDS:
            continue
        tp, optional = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        flag = ("--" + f.name.replace("_", "-"), *_ENGINE_FLAG_ALIASES.get(f.name, ()))
        doc = f"EngineConfig.{f.name}" + ("; None: chosen at start-up" if optional else "")
        if f.name == "speculative_config":
            group.add_argument(*flag, dest=f.name, type=str, default=None,
                               help=doc + ' as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
        elif tp is bool:
            group.add_argument(*flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=doc)
        elif tp is str and optional:
            group.add_argument(*flag, dest=f.name, type=_optional_str, default=default, help=doc + " ('none' = None)")
        elif tp in (int, float, str):
            group.add_argument(*flag, dest=f.name, type=tp, default=default, help=doc)
        elif typing.get_origin(tp) is tuple:
            group.add_argument(*flag, dest=f.name, type=_int_tuple, default=default,
                               help=doc + "; comma-separated integers")


def engine_config_from_args(args: argparse.Namespace, model: str):
    cls = _engine_config_cls()
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
          if f.name not in _SKIP_ENGINE_FIELDS and hasattr(args, f.name)}
    return cls(model=model, **kw)


def add_serve_subcommand(subparsers: Any, add_engine_options: Callable[[argparse.ArgumentParser], None] | None = None
                         ) -> argparse.ArgumentParser:
    """Add `serve` to an argparse subparsers object. Engine options come from `add_engine_options`
    when given (the main CLI's own), else one option per EngineConfig field."""
    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL over HTTP: POST /v1/completions, /v1/chat/completions (streamed as SSE or "
                    "not), GET /v1/models, /health, /metrics (Prometheus). SIGTERM/SIGINT stop accepting, "
                    "let running requests finish (up to --shutdown-timeout seconds, then abort them: streams end with "
                    "finish_reason 'abort' and [DONE]) and exit.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_serve_arguments(p, add_engine_options)
    p.set_defaults(func=serve_main)
    return p


def add_serve_arguments(p: argparse.ArgumentParser,
                        add_engine_options: Callable[[argparse.ArgumentParser], None] | None = None) -> None:
    from metrale_jax.server.reasoning import REASONING_PARSERS
    from metrale_jax.server.tools import TOOL_CALL_PARSERS

    p.add_argument("model", help="model path or alias")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes the server)")
    p.add_argument("--port", type=_port, default=8000, help="port to bind")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/*")
    p.add_argument("--served-model-name", nargs="+", action="extend", default=None, metavar="NAME",
                   help="the names clients use in `model`, instead of MODEL's path (one or more, or the flag "
                        "repeated); responses report the first (default: MODEL as given)")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="the chat template for chat, Responses and /tokenize messages instead of the tokenizer's: "
                        "a Jinja file, or the template itself (a value without '{', '}' or a newline must be a file "
                        "that opens)")
    p.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="bound on waiting requests; past it requests get 503 with Retry-After")
    p.add_argument("--max-request-bytes", type=int, default=4 << 20, help="request body size limit (413 past it)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM (then they are aborted)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) served under NAME (needs --enable-lora); a request's "
                        "`model` picks one")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto": find tool calls in replies with --tool-call-parser')
    p.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                   help="the tool-call format of the model's replies: hermes (Qwen2.5/3, Hermes), "
                        "llama3_json (Llama 3.1-3.3), pythonic (Llama 3.2 / 4), mistral")
    p.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                   help="split thinking models' chat replies into `reasoning` (between <think> and </think>) and "
                        "content: qwen3 (a reply that opens with <think>), deepseek_r1 (reasoning from the start)")
    p.add_argument("--allowed-origins", type=_json_str_list, default=["*"],
                   help='CORS: allowed origins, a JSON list (e.g. \'["https://example.com"]\')')
    p.add_argument("--allowed-methods", type=_json_str_list, default=["*"], help="CORS: allowed methods, a JSON list")
    p.add_argument("--allowed-headers", type=_json_str_list, default=["*"], help="CORS: allowed headers, a JSON list")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies, auth headers)")
    p.add_argument("--log-level", "--uvicorn-log-level", default="info", choices=["debug", "info", "warning", "error"])
    # vLLM's flags that have nothing to switch here: accepted, so that vLLM launch lines run
    p.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM's command lines: every architecture is this package's code")
    p.add_argument("--enforce-eager", action="store_true",
                   help="accepted for vLLM's command lines: the steps are always compiled ahead of time")
    p.add_argument("--disable-log-stats", action="store_true", help="accepted for vLLM's command lines")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="accepted for vLLM's command lines: long prompts are always prefilled in chunks")
    p.add_argument("--structured-outputs-config", "--guided-decoding-backend", dest="structured_outputs_backend",
                   type=_so_backend, default="auto",
                   help="accepted for vLLM's command lines: structured outputs always run on llguidance")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf"],
                   help="accepted for vLLM's command lines: the format is read from the model path")
    p.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this key file (and --ssl-certfile)")
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate file")
    p.add_argument("--root-path", default="", help="the ASGI root_path, behind a path-based proxy")
    p.add_argument("--tokenizer-mode", default="auto", choices=["auto", "slow", "hf"],
                   help="accepted for vLLM's command lines: the tokenizer is always tokenizer.json's (or the GGUF's)")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="no access-log line per finished request (method, path, status, id, tokens, time)")
    g = p.add_argument_group("several hosts (jax.distributed; the same command on every host)")
    g.add_argument("--coordinator-address", default=None, help="host:port of process 0")
    g.add_argument("--num-processes", type=int, default=None)
    g.add_argument("--process-id", type=int, default=None, help="0 serves HTTP; the others run its steps")
    (add_engine_options or add_engine_args)(p)


def serve_main(args: argparse.Namespace) -> int:
    """Build the engine from `args`, then serve until SIGTERM/SIGINT. Returns the exit status."""
    from metrale_jax.engine.engine import LLMEngine
    from metrale_jax.server.app import ServerConfig
    from metrale_jax.server.runner import serve
    from metrale_jax.server.tools import TOOL_CALL_PARSERS

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    auto_tools = getattr(args, "enable_auto_tool_choice", False)
    if auto_tools and args.tool_call_parser is None:
        raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser ({' | '.join(TOOL_CALL_PARSERS)})")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    parser = args.tool_call_parser if auto_tools else None
    if getattr(args, "coordinator_address", None) is not None:
        import jax

        jax.distributed.initialize(args.coordinator_address, num_processes=args.num_processes,
                                   process_id=args.process_id)
    loras = lora_modules_from_args(getattr(args, "lora_modules", None), args.model)
    if loras and not getattr(args, "enable_lora", False):
        raise ValueError("--lora-modules needs --enable-lora")
    chat_template = load_chat_template(getattr(args, "chat_template", None))  # (before the slow load)
    engine = LLMEngine.from_config(engine_config_from_args(args, args.model))
    if engine.lockstep is not None and not engine.lockstep.leader:
        engine.follow_leader()  # until process 0 shuts down
        return 0
    for r in loras:  # refused adapters stop the start-up with a LoRAError naming them
        engine.add_lora(r)
    config = ServerConfig(model_names=served_model_names(args, engine.model_name), api_key=args.api_key,
                          max_waiting_requests=args.max_waiting_requests, chat_template=chat_template,
                          lora_modules=tuple(loras), tool_call_parser=parser,
                          reasoning_parser=getattr(args, "reasoning_parser", None),
                          max_request_bytes=args.max_request_bytes, log_requests=not args.disable_log_requests,
                          **cors_from_args(args))
    try:
        serve(engine, config, host=args.host, port=args.port, shutdown_timeout_s=args.shutdown_timeout,
              log_level=args.log_level, ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
              root_path=args.root_path)
    finally:
        engine.release_followers()
    return 0


def served_model_names(args: argparse.Namespace, engine_model_name: str) -> tuple[str, ...]:
    """vLLM's: the --served-model-name names replace the model's path (which then is no model
    name); without them, MODEL as given and the model's own name."""
    if args.served_model_name:
        return tuple(dict.fromkeys(args.served_model_name))
    names = (args.model,)
    return names + (engine_model_name,) if engine_model_name and engine_model_name not in names else names


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: the text of the file it names, or, when no such file opens and it holds
    Jinja ('{', '}' or a newline), the template itself (vLLM's rule); a value without them is a
    path, so a ValueError when it cannot be opened."""
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        if not any(c in value for c in "{}\n"):
            raise ValueError(f"--chat-template {value!r} looks like a file path, but it cannot be opened: "
                             f"{e.strerror or e}") from None
    return value


def cors_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """ServerConfig's CORS fields from the serve flags (defaults where a parser lacks them)."""
    def flag(name: str) -> tuple[str, ...]:
        v = getattr(args, name, None)
        return ("*",) if v is None else tuple(v)

    return {"allowed_origins": flag("allowed_origins"), "allowed_methods": flag("allowed_methods"),
            "allowed_headers": flag("allowed_headers"),
            "allow_credentials": bool(getattr(args, "allow_credentials", False))}


def lora_modules_from_args(specs: list[str] | None, base: str) -> list:
    """`--lora-modules name=path ...` (or vLLM's JSON form {"name", "path"}) -> LoRARequests with
    ids 1, 2, ...; raises ValueError for a malformed entry."""
    from metrale_jax.lora.request import LoRARequest

    out = []
    for i, spec in enumerate(specs or [], start=1):
        if spec.lstrip().startswith("{"):
            d = json.loads(spec)
            name, path = d.get("name"), d.get("path")
        else:
            name, _, path = spec.partition("=")
        if not name or not path:
            raise ValueError(f"--lora-modules {spec!r}: expected NAME=PATH")
        out.append(LoRARequest(name, i, path, base_model_name=base))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m metrale_jax.server",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return serve_main(args)
    except ValueError as e:  # a refused value (a config value, --chat-template): one line, as `metrale serve`
        print(f"error: {e}", file=sys.stderr)
        return 2
