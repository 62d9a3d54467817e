"""`metrale`: arguments checked before the slow load, clean errors, Ctrl-C, -q, --version.

Models that must load are the tiny fixture checkpoints; a copy of llama_tiny gets a word-level
tokenizer (`w0` .. `w255`, one token per vocabulary id) so that text prompts work and streamed
text is never held back as an incomplete UTF-8 character. Signal tests run `metrale` in a
subprocess.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from metrale_jax import __version__, cli
from metrale_jax.engine import engine as engine_mod
from tests.conftest import FIXTURES

ROOT = Path(__file__).resolve().parents[1]
# one engine shape and compilation cache (the suite's, conftest.py) for every test that builds an
# engine, in this process or in a subprocess, so that they share compiled executables
ENGINE_ARGS = ["--max-model-len", "2048", "--sample-seed", "3"] + (
    ["--compilation-cache-dir", jax.config.jax_compilation_cache_dir] if jax.config.jax_compilation_cache_dir else [])


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory) -> Path:
    """llama_tiny with a word-level tokenizer and 4096 positions (room for long generations)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tmp_path_factory.mktemp("cli") / "tiny"
    shutil.copytree(FIXTURES / "llama_tiny", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 4096  # llama3 RoPE scaling keeps its own original length
    (d / "config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w3"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    return d


def _metrale(*args: str, **kw) -> subprocess.Popen:
    """The CLI in a child process with SIGINT handled as in a terminal: a child inherits an ignored
    SIGINT (and Python then installs no KeyboardInterrupt handler), and pytest started as a
    background job of a non-interactive shell (`pytest ... &`) ignores SIGINT, so the Ctrl-C tests
    saw exit 0 there (session 21)."""
    code = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from metrale_jax.cli import main; sys.exit(main())")
    argv = [sys.executable, "-c", code, *args]
    return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def _no_build(monkeypatch):
    """Fail the test if an engine (the slow compile) is built."""

    def boom(*a, **kw):
        raise AssertionError("the engine was built before the arguments were checked")

    monkeypatch.setattr(engine_mod.LLMEngine, "__init__", boom)


def _no_load(monkeypatch):
    import metrale_jax.model

    def boom(*a, **kw):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(metrale_jax.model, "load_model", boom)


# ---- version, quick argument errors -------------------------------------------------------------
def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    from importlib.metadata import version

    assert capsys.readouterr().out.strip() == f"metrale-jax {version('metrale-jax')}" == f"metrale-jax {__version__}"


@pytest.mark.parametrize("flags, field", [(["--temperature", "-1"], "temperature"), (["--top-p", "0"], "top_p"),
                                          (["--max-tokens", "0"], "max_tokens"), (["--min-p", "2"], "min_p")])
def test_bad_sampling_flags_fail_before_loading(monkeypatch, capsys, flags, field):
    _no_load(monkeypatch)
    assert cli.main(["generate", "hi", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {field} ") and err.count("\n") == 1, err


def test_non_utf8_prompt_is_a_one_line_error():
    """$'bad \\xff byte' on the command line: exit 2 and one line, before anything loads."""
    p = _metrale("generate", "--model", "no-such/model", os.fsdecode(b"bad \xff byte"))
    out, err = p.communicate(timeout=120)
    assert p.returncode == 2, err
    assert err.decode() == "error: the prompt is not UTF-8 text: byte 0xff at character 4\n"
    p = _metrale("generate", "--model", "no-such/model", stdin=subprocess.PIPE)
    out, err = p.communicate(b"ok \xc3\xa9 then \xfe", timeout=120)
    assert p.returncode == 2 and err.decode() == "error: the prompt on stdin is not UTF-8: byte 0xfe at offset 11\n"


def test_text_prompt_without_tokenizer_fails_before_compiling(monkeypatch, capsys):
    _no_build(monkeypatch)
    assert cli.main(["generate", "-q", "--model", str(FIXTURES / "llama_tiny"), "hello"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no tokenizer" in err and err.count("\n") == 1, err


def test_prompt_longer_than_max_model_len_fails_before_compiling(monkeypatch, capsys, tiny_with_tokenizer):
    _no_build(monkeypatch)
    m = str(tiny_with_tokenizer)
    prompt = " ".join(f"w{i % 256}" for i in range(300))  # 300 tokens
    assert cli.main(["generate", "-q", "--model", m, "--max-model-len", "300", prompt]) == 2
    err = capsys.readouterr().err
    assert "300 tokens" in err and "max_model_len=300" in err and err.count("\n") == 1, err
    # the prompt fits, but not with the explicit --max-tokens
    assert cli.main(["generate", "-q", "--model", m, "--max-model-len", "310", "--max-tokens", "11", prompt]) == 2
    err = capsys.readouterr().err
    assert "--max-tokens <= 10" in err and err.count("\n") == 1, err


def test_port_in_use_fails_before_loading(monkeypatch, capsys):
    pytest.importorskip("fastapi")
    _no_load(monkeypatch)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert cli.main(["serve", "no-such/model", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot serve on 127.0.0.1:{port}: ") and "in use" in err, err


def test_serve_without_the_server_extra_says_how_to_install_it():
    code = ("import sys; sys.modules['fastapi'] = None; from metrale_jax.cli import main; "
            "sys.exit(main(['serve', 'x/y', '--port', '1']))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr == ('error: metrale serve needs the server extra (fastapi is not installed): '
                        'pip install "metrale-jax[server]"\n')


# ---- progress bars and buckets --------------------------------------------------------------------
@pytest.mark.parametrize("argv, tty, shown", [(["-q", "generate"], True, False), (["generate", "-q"], True, False),
                                              (["generate"], True, True), (["generate"], False, False)])
def test_quiet_and_non_terminals_get_no_progress_bars(monkeypatch, tiny_with_tokenizer, argv, tty, shown):
    """-q (before or after the command) and a non-terminal stderr turn the loading and compile
    bars off: show_progress reaches load_model and EngineConfig; --revision reaches load_model."""
    import metrale_jax.model

    seen = {}
    real_load = metrale_jax.model.load_model

    def spy_load(path, **kw):
        seen["load"] = kw
        return real_load(path, **kw)

    class Stop(Exception):
        pass

    def spy_engine(self, model, params, config):
        seen["config"] = config
        raise Stop

    monkeypatch.setattr(metrale_jax.model, "load_model", spy_load)
    monkeypatch.setattr(engine_mod.LLMEngine, "__init__", spy_engine)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    with pytest.raises(Stop):
        cli.main([*argv, "--model", str(tiny_with_tokenizer), "--revision", "v2", "w5 w6"])
    assert seen["load"]["show_progress"] is shown and seen["config"].show_progress is shown
    assert seen["load"]["revision"] == "v2" and seen["config"].revision == "v2"
    assert seen["config"].prefill_buckets == (16,)  # a 2-token prompt: the 16-token prefill bucket


def test_lean_buckets():
    args = cli.build_parser().parse_args(["generate", "x"])
    b = cli._lean_buckets(args, 1)
    assert b["prefill_buckets"] == (16, 64, 256) and b["decode_buckets"] == b["mixed_decode_buckets"] == (1,)
    assert cli._lean_buckets(args, 1, prompt_tokens=5)["prefill_buckets"] == (16,)
    assert cli._lean_buckets(args, 1, prompt_tokens=17)["prefill_buckets"] == (64,)
    assert cli._lean_buckets(args, 1, prompt_tokens=5000)["prefill_buckets"] == (256,)  # chunked at the budget
    b = cli._lean_buckets(args, 3, prompt_tokens=40)
    assert b["max_num_seqs"] == 4 and b["decode_buckets"] == (4,) and b["max_prefill_streams"] == 4
    args = cli.build_parser().parse_args(["generate", "x", "--max-num-batched-tokens", "100"])
    assert cli._lean_buckets(args, 1)["prefill_buckets"] == (16, 64, 100)
    args = cli.build_parser().parse_args(["generate", "x", "--max-num-seqs", "8"])
    assert cli._lean_buckets(args, 1) == {}  # explicit engine sizes: the engine's own buckets



def test_quantization_choices():
    """--quantization takes the quantize-on-load choices and vLLM's names of checkpoint formats
    (checked against the checkpoint at load); anything else is refused by the parser. dtype takes
    vLLM's "half" and "float" too."""
    for q in ("int4", "fp8", "gptq", "awq_marlin", "compressed-tensors"):
        args = cli.build_parser().parse_args(["generate", "x", "--quantization", q])
        assert cli.engine_config_from_args(args).quantization == q
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "x", "--quantization", "marlin"])
    from metrale_jax.engine.config import EngineConfig

    with pytest.raises(ValueError, match="quantization='marlin' must be one of"):  # (serve: EngineConfig checks it)
        EngineConfig(model="x", quantization="marlin")
    assert EngineConfig(model="x", dtype="half").dtype == "float16"
    assert EngineConfig(model="x", dtype="float").dtype == "float32"
    with pytest.raises(ValueError, match="dtype 'fp16' is not supported"):
        EngineConfig(model="x", dtype="fp16")


# ---- Ctrl-C --------------------------------------------------------------------------------------
def _interrupt(p: subprocess.Popen, ready, after: float = 0.3) -> tuple[bytes, bytes]:
    """Send SIGINT `after` seconds past the moment `ready()` returns, then collect the output."""
    ready()
    time.sleep(after)
    p.send_signal(signal.SIGINT)
    return p.communicate(timeout=120)


def test_ctrl_c_while_streaming_exits_130(tiny_with_tokenizer):
    p = _metrale("generate", "-q", "--stream", "--model", str(tiny_with_tokenizer), "--max-tokens", "2000",
                 "--ignore-eos", *ENGINE_ARGS, "w5 w6 w7")
    first = []
    out, err = _interrupt(p, lambda: first.append(os.read(p.stdout.fileno(), 64)))
    err = err.decode()
    assert first[0].strip().startswith(b"w"), first  # it was streaming when interrupted
    assert p.returncode == 130, err
    assert "terminate called" not in err and "Traceback" not in err
    assert err.strip() == "[interrupted]", err  # -q: no logs, no progress bars
    assert len((first[0] + out).split()) < 1990  # it stopped early


def test_ctrl_c_leaves_no_step_in_flight(monkeypatch, capsys, tiny_with_tokenizer):
    """The cause of the old `terminate called without an active exception` (exit -6): Ctrl-C left
    a dispatched step running on the device while the interpreter exited. After the interrupt the
    engine must have nothing in flight and every state array computed."""
    import jax

    engines = []
    real_step = engine_mod.LLMEngine.step

    def step(self):
        out = real_step(self)  # dispatches the next step, then reads the previous one
        engines.append(self)
        if len(engines) == 5:
            raise KeyboardInterrupt  # as if Ctrl-C came right after a dispatch
        return out

    monkeypatch.setattr(engine_mod.LLMEngine, "step", step)
    argv = ["generate", "-q", "--model", str(tiny_with_tokenizer), "--max-tokens", "500", "--ignore-eos",
            *ENGINE_ARGS, "w5 w6 w7"]
    assert cli.main(argv) == 130
    eng = engines[0]
    assert len(engines) > 5  # the drain stepped on to read the dispatched step back
    assert not eng.has_unfinished_requests() and not eng.requests
    assert all(x.is_ready() for x in jax.tree.leaves(eng.state))
    assert eng.stats().kv_blocks_used == 0  # the aborted request gave its blocks back
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == "[interrupted]"


def test_serve_flags_as_vllm_takes_them(monkeypatch, capsys):
    """vLLM's launch lines run: --trust-remote-code / --enforce-eager / --disable-log-stats /
    --enable-chunked-prefill / --tokenizer-mode auto are accepted, --kv-cache-dtype is --kv-dtype
    (with vLLM's values: fp8), --download-dir the hub cache, --ssl-* / --root-path reach uvicorn,
    --structured-outputs-config / --load-format are checked, --uvicorn-log-level is --log-level; a port outside
    0-65535 and --lora-modules without --enable-lora are errors before anything loads."""
    pytest.importorskip("fastapi")
    from metrale_jax.server.cli import engine_config_from_args

    parser = cli.build_parser()
    args = parser.parse_args(["serve", "m", "--trust-remote-code", "--enforce-eager", "--disable-log-stats",
                              "--kv-cache-dtype", "bfloat16", "--uvicorn-log-level", "warning", "--port", "0"])
    assert (args.kv_dtype, args.log_level, args.port) == ("bfloat16", "warning", 0)
    assert engine_config_from_args(args, "m").kv_dtype == "bfloat16"
    args = parser.parse_args(["serve", "m", "--kv-cache-dtype", "fp8", "--download-dir", "/hf", "--tokenizer-mode",
                              "auto", "--enable-chunked-prefill", "--reasoning-parser", "deepseek_r1",
                              "--hf-overrides", '{"max_position_embeddings": 8}'])
    cfg = engine_config_from_args(args, "m")
    assert args.reasoning_parser == "deepseek_r1" and (cfg.kv_dtype, cfg.download_dir) == ("float8_e4m3fn", "/hf")
    assert cfg.hf_overrides == '{"max_position_embeddings": 8}'
    args = parser.parse_args(["serve", "m", "--structured-outputs-config", '{"backend": "xgrammar"}', "--load-format",
                              "safetensors", "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem", "--root-path", "/v"])
    assert (args.structured_outputs_backend, args.ssl_keyfile, args.root_path) == ("xgrammar", "k.pem", "/v")
    assert parser.parse_args(["serve", "m", "--guided-decoding-backend", "guidance"]).structured_outputs_backend \
        == "guidance"
    for bad in (["--structured-outputs-config", '{"backend": "nope"}'], ["--load-format", "pt"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "m", *bad])
    from metrale_jax.server import runner

    # (uvicorn.Config itself would configure logging onto this test's captured stderr, closed after it)
    monkeypatch.setattr(runner.uvicorn, "Config", lambda app, **kw: kw)
    uv = runner._uvicorn_config(None, "127.0.0.1", 0, 1.0, "info", ssl_keyfile="k.pem", ssl_certfile="c.pem",
                                root_path="/v")
    assert (uv["ssl_keyfile"], uv["ssl_certfile"], uv["root_path"]) == ("k.pem", "c.pem", "/v")
    monkeypatch.undo()
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "m", "--port", "99999"])
    assert "is not a TCP port" in capsys.readouterr().err
    monkeypatch.setattr(engine_mod.LLMEngine, "from_config", lambda c: pytest.fail("loaded"))
    assert cli.main(["serve", "m", "--port", "0", "--lora-modules", "a=/tmp/a"]) == 2
    assert "error: --lora-modules needs --enable-lora" in capsys.readouterr().err
    assert cli.main(["serve", "m", "--port", "0", "--enable-auto-tool-choice"]) == 2
    assert "error: --enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err
    assert cli.main(["serve", "m", "--port", "0", "--ssl-keyfile", "k.pem"]) == 2
    assert "error: --ssl-keyfile and --ssl-certfile go together" in capsys.readouterr().err


def test_bad_config_values_are_one_line_errors(capsys, tiny_with_tokenizer):
    """An EngineConfig value the engine refuses (a ValueError) is `error: ...` and exit 2, no
    traceback; --max-model-len 0 is refused, not read as "the default"."""
    assert cli.main(["generate", "-q", "--model", str(tiny_with_tokenizer), "--max-model-len", "0", "w5 w6"]) == 2
    err = capsys.readouterr().err
    assert "error: " in err and "max_model_len" in err and "Traceback" not in err, err


def test_missing_generation_config_folder_is_refused_before_loading(monkeypatch, tmp_path, capsys):
    """--generation-config FOLDER without generation_config.json: one error line before the model
    loads (it used to come after a load of minutes); EngineConfig refuses it at construction."""
    from metrale_jax.engine.config import EngineConfig

    nowhere = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="no generation_config.json"):
        EngineConfig(generation_config=nowhere)
    monkeypatch.setattr(cli, "_load", lambda args: pytest.fail("loaded the model"))
    for cmd in (["generate", "x"], ["chat"]):
        assert cli.main([*cmd, "-q", "--generation-config", nowhere]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: generation_config=") and err.count("\n") == 1, err



def test_generate_and_chat_take_tokenizer_and_generation_config(monkeypatch, tmp_path, tiny_with_tokenizer):
    """--tokenizer and --generation-config (serve's flags, vLLM's) on generate and chat: parsed into
    the EngineConfig; the tokenizer replaces the model's own, and the generation config's sampling
    values fill the sampling flags left out (a flag given wins; what neither sets, the CLI's default)."""
    for cmd in (["generate", "x"], ["chat"]):
        args = cli.build_parser().parse_args([*cmd, "--tokenizer", "/tok", "--generation-config", "vllm"])
        cfg = cli.engine_config_from_args(args)
        assert (cfg.tokenizer, cfg.generation_config) == ("/tok", "vllm")
        cfg = cli.engine_config_from_args(cli.build_parser().parse_args(cmd))
        assert (cfg.tokenizer, cfg.generation_config) == (None, "auto")
    gen = tmp_path / "gen"
    gen.mkdir()
    (gen / "generation_config.json").write_text(json.dumps({"temperature": 0.25, "top_k": 7, "max_new_tokens": 9}))
    seen = {}

    class Stop(Exception):
        pass

    def spy_engine(self, model, params, config):
        seen["tokenizer"], seen["config"] = model.tokenizer, config
        raise Stop

    real_prompt_ids = cli._prompt_ids

    def spy_prompt_ids(args, model, prompts, sp, max_model_len):
        seen["sp"] = sp
        return real_prompt_ids(args, model, prompts, sp, max_model_len)

    monkeypatch.setattr(cli, "_prompt_ids", spy_prompt_ids)
    monkeypatch.setattr(engine_mod.LLMEngine, "__init__", spy_engine)
    with pytest.raises(Stop):  # llama_tiny has no tokenizer of its own: this text prompt needs --tokenizer's
        cli.main(["generate", "-q", "--model", str(FIXTURES / "llama_tiny"), "--tokenizer", str(tiny_with_tokenizer),
                  "--generation-config", str(gen), "--top-k", "3", "w5 w6"])
    assert seen["tokenizer"] is not None and seen["config"].tokenizer == str(tiny_with_tokenizer)
    assert seen["config"].generation_config == str(gen)
    sp = seen["sp"]
    assert (sp.temperature, sp.top_k, sp.max_tokens, sp.top_p) == (0.25, 3, 9, 0.95)
