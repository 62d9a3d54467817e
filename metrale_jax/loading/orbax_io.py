"""Save and restore converted parameter pytrees with orbax-checkpoint.

A dequantized GGUF (or any converted checkpoint) is saved once; the next load restores it
instead of converting again. Layout of a saved directory:

    <directory>/params/     orbax StandardCheckpointer output (every leaf stored as a numpy array)
    <directory>/meta.json   caller metadata; written last, so its presence marks a complete save

Leaves are stored and restored as host numpy arrays with their dtypes kept (bfloat16 included),
so a cache written on one machine restores on another regardless of devices; put them on the
device afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401 - registers "bfloat16" etc. with numpy, for np.dtype(name)
import numpy as np

from metrale_jax.errors import CorruptCheckpointError, ModelNotFoundError
from metrale_jax.loading.hub import cache_dir

# Bump when the conversion (names, layouts, dequantization) changes, so old caches are not reused.
CONVERSION_VERSION = 1


def _to_host(tree: Any) -> Any:
    import jax

    return jax.tree.map(lambda x: np.asarray(x), tree)


def save_params(params: Any, directory: str | os.PathLike, meta: dict) -> Path:
    """Save a pytree of jax/numpy arrays (`params`) and a JSON-able dict (`meta`) to `directory`.

    An incomplete one at `directory` is replaced; a complete one is kept (another process saved
    the same parameters first: several servers or test workers may convert one model at once).
    Returns the directory.
    """
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    directory.parent.mkdir(parents=True, exist_ok=True)
    meta_text = json.dumps(meta, indent=1, sort_keys=True, default=str)
    # Write to a sibling temp folder, then swap it in, so a crash never leaves a half-written cache.
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(tmp / "params", _to_host(params))
            ckptr.wait_until_finished()
        (tmp / "meta.json").write_text(meta_text)
        if has_params(directory):
            return directory
        if directory.exists():
            shutil.rmtree(directory, ignore_errors=True)
        try:
            os.replace(tmp, directory)
        except OSError:
            if not has_params(directory):  # not another process's complete save: a real failure
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return directory


def has_params(directory: str | os.PathLike) -> bool:
    """Whether `directory` holds a complete save_params output."""
    d = Path(directory)
    return (d / "meta.json").is_file() and (d / "params").is_dir()


def restore_params(directory: str | os.PathLike) -> tuple[Any, dict]:
    """Restore `(params, meta)` saved by `save_params`. Leaves come back as numpy arrays."""
    import orbax.checkpoint as ocp

    d = Path(directory).absolute()
    if not has_params(d):
        raise ModelNotFoundError(f"{d} holds no saved parameters (expected params/ and meta.json)")
    try:
        meta = json.loads((d / "meta.json").read_text())
    except ValueError as e:
        raise CorruptCheckpointError(f"{d / 'meta.json'}: invalid JSON: {e}") from e
    try:
        with ocp.StandardCheckpointer() as ckptr:
            params = ckptr.restore(d / "params")
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise assorted types on damaged files
        raise CorruptCheckpointError(f"{d / 'params'}: could not restore: {type(e).__name__}: {e}") from e
    return params, meta


def conversion_cache_dir(source_path: str | os.PathLike, dtype: Any) -> Path:
    """Where the converted parameters of `source_path` in `dtype` are cached.

    The key covers the source's absolute path, size and modification time (so a replaced file gets
    a new entry) plus the dtype and CONVERSION_VERSION:
    `<cache>/converted/<file name>-<16 hex digits>-<dtype>`.
    """
    p = Path(source_path).absolute()
    st = p.stat()
    name = np.dtype(dtype).name
    key = f"{p}\0{st.st_size}\0{st.st_mtime_ns}\0{name}\0v{CONVERSION_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / "converted" / f"{p.name}-{digest}-{name}"
