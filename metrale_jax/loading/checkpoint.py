"""Open a checkpoint: config, tensors, tokenizer, generation config and EOS ids in one object.

Accepted paths:
- a Hugging Face folder with `config.json` and safetensors (single, sharded, or any set);
- a `.gguf` file, or a folder holding exactly one `.gguf` (and no config.json).

The tokenizer is optional: a folder without `tokenizer.json` (or a GGUF without tokenizer
metadata) loads with `tokenizer=None`, and the model then takes token ids only.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from metrale_jax.config import parse_json_floats
from metrale_jax.errors import CorruptCheckpointError, ModelNotFoundError
from metrale_jax.loading.tensors import GGUFSource, SafetensorsSource, TensorSource
from metrale_jax.loading.tokenizer import Tokenizer


@dataclass
class Checkpoint:
    """An opened checkpoint. Close it (or use it as a context manager) to release file handles."""

    path: Path
    config: dict  # HF-style config.json dict (hub or transformers-5 dialect, infinities parsed)
    tensors: TensorSource
    tokenizer: Tokenizer | None
    generation_config: dict = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    format: str = "safetensors"  # "safetensors" | "gguf"

    def close(self) -> None:
        self.tensors.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_json(path: Path) -> dict:
    """A JSON object file, with transformers-5 `{"__float__": "Infinity"}` values parsed.

    Raises CorruptCheckpointError naming the file when it is truncated or not a JSON object.
    """
    try:
        text = path.read_text(encoding="utf-8")
        obj = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{path}: truncated or invalid JSON: {e}") from e
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return parse_json_floats(obj)


def _ids(v: Any) -> list[int]:
    """An eos_token_id entry: an int, a list of ints, or None."""
    if v is None:
        return []
    if isinstance(v, list | tuple):
        return [int(x) for x in v if x is not None]
    return [int(v)]


def resolve_eos_token_ids(generation_config: dict, config: dict, tokenizer: Tokenizer | None) -> tuple[int, ...]:
    """EOS ids: generation_config.json first, then config.json, then the tokenizer (first non-empty)."""
    for ids in (_ids(generation_config.get("eos_token_id")), _ids(config.get("eos_token_id")),
                list(tokenizer.eos_token_ids) if tokenizer is not None else []):
        if ids:
            return tuple(dict.fromkeys(ids))  # dedupe, keep order
    return ()


def _find_gguf(p: Path) -> Path | None:
    if p.is_file() and p.suffix.lower() == ".gguf":
        return p
    if p.is_dir() and not (p / "config.json").is_file():
        ggufs = sorted(x for x in p.glob("*.gguf") if x.is_file())
        if len(ggufs) == 1:
            return ggufs[0]
        if len(ggufs) > 1:
            raise ModelNotFoundError(
                f"{p} holds {len(ggufs)} .gguf files ({', '.join(x.name for x in ggufs)}); pass one of them"
            )
    return None


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Open a checkpoint folder or GGUF file. See the module docstring for the accepted layouts."""
    p = Path(os.path.expanduser(os.fspath(path)))
    if not p.exists():
        raise ModelNotFoundError(f"checkpoint path {p} does not exist")

    gguf_path = _find_gguf(p)
    if gguf_path is not None:
        src = GGUFSource(gguf_path)
        config = src.hf_config()
        tokenizer = None
        if src.reader.fields.get("tokenizer.ggml.model") is not None:
            tokenizer = Tokenizer.from_gguf(src.reader)
        gen: dict = {}
        for key, hf in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
            if key in config:
                gen[hf] = config[key]
        return Checkpoint(
            path=gguf_path, config=config, tensors=src, tokenizer=tokenizer, generation_config=gen,
            eos_token_ids=resolve_eos_token_ids({}, config, tokenizer), format="gguf",
        )

    if p.is_file():
        raise ModelNotFoundError(f"{p} is neither a .gguf file nor a checkpoint folder")
    cfg_path = p / "config.json"
    if not cfg_path.is_file():
        raise ModelNotFoundError(f"{p} has no config.json and no .gguf file; it is not a checkpoint")
    config = read_json(cfg_path)
    quant_path = p / "hf_quant_config.json"  # ModelOpt exports that keep their quantization beside config.json
    if config.get("quantization_config") is None and quant_path.is_file():
        config["quantization_config"] = {"quant_method": "modelopt", **read_json(quant_path)}
    gen_path = p / "generation_config.json"
    generation_config = read_json(gen_path) if gen_path.is_file() else {}
    tokenizer = Tokenizer.from_dir(p) if (p / "tokenizer.json").is_file() else None
    has_st = (p / "model.safetensors.index.json").is_file() or any(p.glob("*.safetensors"))
    if not has_st:
        raise ModelNotFoundError(f"{p} has config.json but no *.safetensors weights")
    tensors = SafetensorsSource(p)
    return Checkpoint(
        path=p, config=config, tensors=tensors, tokenizer=tokenizer, generation_config=generation_config,
        eos_token_ids=resolve_eos_token_ids(generation_config, config, tokenizer), format="safetensors",
    )


def load_tokenizer(name_or_path: str | os.PathLike, show_progress: bool = True) -> Tokenizer:
    """A tokenizer alone (`EngineConfig.tokenizer`): a folder with tokenizer.json, a GGUF file (or a
    folder holding one), an alias or a Hugging Face repo id (fetched as a model is)."""
    from metrale_jax.loading.hub import resolve_model

    p = resolve_model(name_or_path, show_progress=show_progress)
    gguf_path = _find_gguf(p)
    if gguf_path is not None:
        return Tokenizer.from_gguf(gguf_path)
    if p.is_dir() and (p / "tokenizer.json").is_file():
        return Tokenizer.from_dir(p)
    raise ModelNotFoundError(f"tokenizer {name_or_path!r}: {p} holds neither tokenizer.json nor a .gguf file")
