"""`Model` (a static, hashable handle on one family and config) and `load_model`."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from metrale_jax.cache import EngineState
from metrale_jax.cache.kv import init_kv_cache, kv_bytes_per_block
from metrale_jax.config import (
    CHECKPOINT_QUANTIZATIONS,
    DTYPE_ALIASES,
    DTYPE_NAMES,
    QUANTIZATIONS,
    ModelConfig,
    check_quantization_name,
)
from metrale_jax.errors import LoadError
from metrale_jax.layers.attention import AttentionConfig
from metrale_jax.metadata import AttnMetadata, BatchedAttnMetadata
from metrale_jax.models import family_for

log = logging.getLogger(__name__)

DTYPES = {name: getattr(jnp, name) for name in DTYPE_NAMES}


@dataclass(frozen=True)
class Model:
    """A model family bound to its config. Hashable: pass it to jit as a static argument.

    The tokenizer rides along for convenience but takes no part in hashing.
    """

    cfg: ModelConfig
    family_name: str
    dtype: str = "float32"
    name: str = ""
    eos_token_ids: tuple[int, ...] = ()
    tokenizer: Any = field(default=None, compare=False, hash=False, repr=False)
    # generation_config.json (its sampling fields are the engine's request defaults, as vLLM's)
    generation_config: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    # how the weights are stored: the checkpoint's quant_method ("gptq", "awq", "compressed-tensors",
    # "modelopt", "fp8", ...; "gguf"), the quantize-on-load choice ("fp8", "int4", "nvfp4"), or None
    quantization: str | None = field(default=None, compare=False, hash=False)

    @property
    def family(self):
        return importlib.import_module(f"metrale_jax.models.{self.family_name}")

    # ---- research API ----
    def forward(self, params, tokens, positions=None, lengths=None):
        """Dense forward. tokens i32[B, T], positions i32[B, T] (default 0..T-1),
        lengths i32[B] (right padding; default T) -> logits f32[B, T, V]."""
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if lengths is None:
            lengths = jnp.full((b,), t, jnp.int32)
        return self.family.forward(self.cfg, params, tokens, positions, lengths)

    # ---- engine API ----
    def forward_paged(self, params, state: EngineState, tokens, dmd: AttnMetadata | None,
                      pmd: BatchedAttnMetadata | None, attn: AttentionConfig = AttentionConfig()):
        """tokens i32[N + T] (decode rows, then prefill tokens) -> (state, hidden [N + T, H])."""
        return self.family.forward_paged(self.cfg, params, state, tokens, dmd, pmd, attn)

    def compute_logits(self, params, hidden):
        """hidden [S, H] -> f32[S, V]."""
        return self.family.compute_logits(self.cfg, params, hidden)

    @property
    def has_experts(self) -> bool:
        """Whether the model has routed MoE experts (Qwen3-MoE, Qwen3-Next, Nemotron-H's MoE)."""
        return bool(self.cfg.get("num_experts") or self.cfg.get("n_routed_experts"))

    def pallas_unsupported(self) -> str | None:
        """Why the Pallas kernels cannot run this model, or None when they can."""
        d = self.cfg.head_dim
        if self.num_attention_layers and (d < 16 or d & (d - 1)):
            return f"head_dim={d} is not a power of two >= 16"
        return None

    @property
    def num_attention_layers(self) -> int:
        return self.family.num_attention_layers(self.cfg)

    def ssm_spec(self) -> dict:
        """Per-slot SSM state arrays {kind: {name: SSMArraySpec}}; empty for attention-only models."""
        spec = getattr(self.family, "ssm_spec", None)
        return spec(self.cfg) if spec is not None else {}

    @property
    def decode_matches_prefill(self) -> bool:
        """Whether a token goes through the decode path with the numerics of the prefill path (up to
        rounding). False for Nemotron-H with a dt floor: transformers' prefill clamps dt and its
        step path does not, so the prefix cache reuses only what prefill chunks computed."""
        fn = getattr(self.family, "decode_matches_prefill", None)
        return fn(self.cfg) if fn is not None else True

    @property
    def has_ssm_state(self) -> bool:
        return bool(self.ssm_spec())

    def init_state(self, num_blocks: int, block_size: int, kv_dtype=None, max_ssm_slots: int = 0,
                   extra_kv_layers: int = 0) -> EngineState:
        """Zeroed pools; `extra_kv_layers` KV layers after the model's own (an MTP drafter's)."""
        from metrale_jax.cache.ssm import init_ssm_pool

        kv_dtype = kv_dtype or DTYPES[self.dtype]
        c = self.cfg
        kv = init_kv_cache(self.num_attention_layers + extra_kv_layers, num_blocks, block_size, c.num_kv_heads,
                           c.head_dim, kv_dtype)
        spec = self.ssm_spec()
        if spec and max_ssm_slots <= 0:
            raise ValueError(f"{c.architecture} keeps recurrent state: max_ssm_slots must be > 0")
        return EngineState(kv=kv, ssm=init_ssm_pool(spec, max_ssm_slots) if spec else {})

    def kv_bytes_per_block(self, block_size: int, kv_dtype=None, extra_kv_layers: int = 0) -> int:
        c = self.cfg
        return kv_bytes_per_block(self.num_attention_layers + extra_kv_layers, block_size, c.num_kv_heads,
                                  c.head_dim, kv_dtype or DTYPES[self.dtype])

    def ssm_bytes_per_slot(self) -> int:
        from metrale_jax.cache.ssm import ssm_bytes_per_slot

        return ssm_bytes_per_slot(self.ssm_spec())


def load_model(
    path: str | Path, dtype: str = "auto", show_progress: bool = True, cache_converted: bool = True,
    quantization: str | None = None, revision: str | None = None, split_layers: bool = False, sharder=None,
    mtp: bool = False, download_dir: str | None = None, hf_overrides: dict | None = None,
) -> tuple[Model, dict]:
    """Load a checkpoint (HF safetensors directory, GGUF file, a known alias, or a Hugging Face
    repo id `org/name` at `revision`, fetched with huggingface_hub: `loading/hub.py`) -> (model, params).

    dtype: "auto" (the checkpoint's own float dtype; float32 for GGUF), "float32", "bfloat16"
    or "float16". FP8 block-scaled checkpoints (`quantization_config.quant_method == "fp8"`)
    keep their FP8 linears; `quantization="fp8"` quantizes every decoder linear of a
    higher-precision checkpoint to the same 128x128-block format at load. 4-bit checkpoints
    (GPTQ, AWQ, compressed-tensors W4A16 / NVFP4, ModelOpt NVFP4: `quant/w4.py`) keep their
    linears 4-bit (`layers.linear.W4Linear`); `quantization="int4"` / `"nvfp4"` quantize to them. A GGUF's dequantized
    parameters are saved with orbax on first load (`cache_converted`), so later loads skip the
    dequantization. `split_layers`: put layer-stacked parameters on the device as per-layer
    arrays (`layers.stack.Unstacked`), the layout of the engine's Python layer loop (its GPU
    default), which otherwise splits them itself, through host memory (11-12 s for 8B weights);
    `LLM(...)` / `LLMEngine.from_config` ask for it when the engine will walk the layers in Python.
    Leave it off for `model.forward` under `lax.scan` (research use), which would re-stack the
    parts. `mtp`: also read the checkpoint's multi-token-prediction head (`mtp.*`, Qwen3-Next) into
    params["mtp"], the drafter of `speculative_config={"method": "mtp"}` (skipped otherwise).
    `sharder` (a `parallel.Sharder`): place every parameter on its tensor-parallel shards
    while reading, a layer at a time (each device receives only its slice, and the host holds one
    layer of a parameter, never the whole model); `LLM(..., tensor_parallel_size=N)` asks for it.
    `download_dir`: the Hugging Face cache a repo id downloads into (vLLM's; None: huggingface_hub's).
    `hf_overrides`: config.json keys replaced before the model is built (vLLM's; top-level keys).
    Raises a `LoadError` subclass naming the file or tensor on any problem.
    """
    from metrale_jax.layers.stack import device_put_layers, host_stacked
    from metrale_jax.loading import orbax_io
    from metrale_jax.loading.checkpoint import open_checkpoint
    from metrale_jax.loading.hub import resolve_model
    from metrale_jax.loading.weights import WeightReader, np_dtype

    t0 = time.perf_counter()
    resolved = resolve_model(path, revision=revision, show_progress=show_progress, hub_cache=download_dir)
    ckpt = open_checkpoint(resolved)
    if hf_overrides:
        ckpt.config = {**ckpt.config, **hf_overrides}
    cfg = ModelConfig.from_hf(ckpt.config)
    fam_name, fam = family_for(cfg.architecture)
    cfg = fam.adapt_config(cfg)
    if ckpt.eos_token_ids:
        cfg = dataclasses.replace(cfg, eos_token_ids=tuple(ckpt.eos_token_ids))
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype == "auto":
        dtype = cfg.torch_dtype if cfg.torch_dtype in DTYPES else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} must be 'auto' or one of {sorted(DTYPES)}")
    qc = ckpt.config.get("quantization_config")
    quantization = checkpoint_quantization(quantization, qc, ckpt.format, path)
    _check_quantization(quantization)
    w4_scheme = dense_scheme = None
    if qc is not None:
        from metrale_jax.quant.bnb import parse_bnb_config
        from metrale_jax.quant.fp8 import check_fp8_quantization_config
        from metrale_jax.quant.int8 import parse_int8_config
        from metrale_jax.quant.w4 import parse_w4_config

        # read dense: 8-bit GPTQ, compressed-tensors W8A16 / W8A8-INT8, bitsandbytes
        dense_scheme = parse_int8_config(qc) or parse_bnb_config(qc)
        w4_scheme = None if dense_scheme else parse_w4_config(qc)  # GPTQ, AWQ, compressed-tensors, NVFP4
        if dense_scheme is None and w4_scheme is None:
            check_fp8_quantization_config(qc)
        if quantization is not None:
            raise ValueError(f"quantization={quantization!r}: {path} is already quantized")
    cache_dir = None
    if cache_converted and ckpt.format == "gguf" and quantization is None:
        cache_dir = orbax_io.conversion_cache_dir(ckpt.path, np_dtype(dtype))
    try:
        if cache_dir is not None and orbax_io.has_params(cache_dir):
            host, _ = orbax_io.restore_params(cache_dir)
            if sharder is not None:
                params = WeightReader(None, dtype, split_layers=split_layers, sharder=sharder).to_device(host)
            else:
                params = device_put_layers(host) if split_layers else jax.tree.map(jax.device_put, host)
            log.info("restored converted parameters from %s", cache_dir)
        else:
            reader = WeightReader(ckpt.tensors, dtype, origin=str(resolved), show_progress=show_progress,
                                  quantize_fp8=quantization == "fp8", split_layers=split_layers,
                                  w4_scheme=w4_scheme, quantize_w4=_w4_quantization(quantization),
                                  sharder=sharder, dense_scheme=dense_scheme)
            try:
                params = fam.load_params(cfg, reader)
            except jax.errors.JaxRuntimeError as e:
                if "RESOURCE_EXHAUSTED" not in str(e) or not reader.dequantized:
                    raise
                raise LoadError(f"{path}: out of device memory while loading, with {_dense_summary(reader, dtype)}; "
                                "the dense copies of those weights do not fit") from e
            if mtp:
                mtp_reader = WeightReader(ckpt.tensors, dtype, origin=str(resolved), show_progress=show_progress,
                                          w4_scheme=w4_scheme, dense_scheme=dense_scheme)
                params["mtp"] = _load_mtp(fam, cfg, mtp_reader, split_layers)
                reader.dequantized += mtp_reader.dequantized
            if reader.dequantized:
                log.warning("%s: %s", path, _dense_summary(reader, dtype))
            if cache_dir is not None:
                orbax_io.save_params(host_stacked(params) if split_layers else params, cache_dir,
                                     {"source": str(ckpt.path), "dtype": dtype})
    finally:
        ckpt.close()
    if quantization is not None:
        _quantize_on_load_report(params, quantization, cfg.architecture, dtype)
    stored = "gguf" if ckpt.format == "gguf" else str(qc.get("quant_method")) if isinstance(qc, dict) else None
    model = Model(cfg=cfg, family_name=fam_name, dtype=dtype, name=str(path),
                  eos_token_ids=tuple(cfg.eos_token_ids), tokenizer=ckpt.tokenizer,
                  generation_config=dict(ckpt.generation_config), quantization=quantization or stored)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    log.info("loaded %s (%s, %s, %.1f MB) in %.1fs", path, cfg.architecture, dtype, nbytes / 1e6,
             time.perf_counter() - t0)
    return model, params


# parameter keys that are not linears a quantize-on-load choice would take (embeddings, the LM head,
# norms, routers, the SSM's conv / A / D / dt, per-token gates of one column)
_NOT_LINEAR = re.compile(r"embed|lm_head|norm|router|conv|A_log|dt_bias|(^|\.)D$|shared_gate$")


def _quantize_on_load_report(params, quantization: str, arch: str, dtype: str) -> None:
    """After a quantize-on-load (`quantization` "fp8" / "int4" / "nvfp4"): a ValueError when no
    linear took it, a warning naming the matrices that stay `dtype` when some did (every family's
    linears and experts take it since session 42; a family whose loader reads a matrix without
    `WeightReader.linears` would show here)."""
    from metrale_jax.layers.linear import Fp8Linear, W4Linear

    kinds = (Fp8Linear, W4Linear)
    quantized, dense = set(), set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda w: isinstance(w, kinds))[0]:
        names = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
        key = ".".join(names)
        if isinstance(leaf, kinds):
            quantized.add(key)
            continue
        # (a layer-stacked array: its first axis is the layers; `Unstacked` parts are one layer each)
        stacked = names[:1] == ["layers"] and not any(isinstance(k, jax.tree_util.SequenceKey) for k in path)
        shape = tuple(getattr(leaf, "shape", ()))[1 if stacked else 0:]
        if len(shape) >= 2 and sorted(shape)[-2] >= 16 and not _NOT_LINEAR.search(key):
            dense.add(key)
    if not dense:
        return
    if not quantized:
        raise ValueError(f"quantization={quantization!r}: no linear of {arch} takes it (its matrices "
                         f"{', '.join(sorted(dense))} have no {quantization} path here); load it without quantization")
    log.warning("quantization=%r: %s's %s stay %s (no %s path for them here); quantized: %s", quantization, arch,
                ", ".join(sorted(dense)), dtype, quantization, ", ".join(sorted(quantized)))


def _dense_summary(reader, dtype: str) -> str:
    """What `WeightReader.dequantized` lists, in a line: how many, and which layers (indices as *)."""
    kinds = sorted({re.sub(r"\.\d+\.", ".*.", n) for n in reader.dequantized})
    why = (f"no kernel here runs {reader.dense_scheme.label} weights" if reader.dense_scheme is not None else
           "no 4-bit or FP8 kernel here takes these layers or scales")
    return (f"{len(reader.dequantized)} quantized weights dequantized to {dtype} at load, to run dense ({why}): "
            f"{', '.join(kinds)}")


def _load_mtp(fam, cfg: ModelConfig, reader, split_layers: bool) -> dict:
    """params["mtp"]: the family's MTP head (`load_mtp`), read layer-stacked, then split like the
    rest when the engine walks layers in Python."""
    if not hasattr(fam, "load_mtp"):
        raise ValueError(f"{cfg.architecture} has no multi-token-prediction head: speculative_config "
                         f"method='mtp' needs a model that ships one (Qwen3-Next); use method='ngram'")
    head = fam.load_mtp(cfg, reader)
    if split_layers:
        from metrale_jax.layers.stack import split_layers as split

        split({"mtp": head})
    return head


def checkpoint_quantization(quantization: str | None, qc: dict | None, fmt: str, path) -> str | None:
    """`quantization` as `load_model` acts on it: None where it names the checkpoint's own format
    (`CHECKPOINT_QUANTIZATIONS`: "gptq" for a GPTQ checkpoint, "fp8" for an FP8 one, ...), the
    value itself for a quantize-on-load choice of an unquantized checkpoint; a ValueError naming
    both where they disagree."""
    if quantization not in CHECKPOINT_QUANTIZATIONS:
        return quantization
    method = "gguf" if fmt == "gguf" else str(qc.get("quant_method", "")).lower() if qc else None
    if method == CHECKPOINT_QUANTIZATIONS[quantization]:
        return None
    if method is None:
        if quantization == "fp8":  # (vLLM's FP8 of an unquantized checkpoint: quantize at load)
            return quantization
        raise ValueError(f"quantization={quantization!r} names a checkpoint format, but {path} is not quantized "
                         f"(its config.json has no quantization_config); quantize at load with one of "
                         f"{[q for q in QUANTIZATIONS if q]}")
    raise ValueError(f"quantization={quantization!r} does not match {path}'s quantization ({method!r}); "
                     "leave it unset: the checkpoint's format is read from its config")


def _check_quantization(quantization) -> bool:
    """True for "fp8" (quantize on load), False for None, "int4" or "nvfp4"; anything else is an error."""
    check_quantization_name(quantization)
    if quantization not in QUANTIZATIONS:  # (a checkpoint format's name `checkpoint_quantization` let through)
        raise ValueError(f"quantization={quantization!r} names a checkpoint format, not a quantize-on-load choice")
    return quantization == "fp8"


def _w4_quantization(quantization) -> str | None:
    """ "int4" (asymmetric RTN, group 128) or "nvfp4" (quant/w4.py) for 4-bit quantize-on-load, else None."""
    return quantization if quantization in ("int4", "nvfp4") else None


def random_model(config: dict, dtype: str = "float32", seed: int = 0, scale: float = 0.2,
                 repeat_layers: bool = False, quantization: str | None = None,
                 split_layers: bool = False, sharder=None, mtp: bool = False) -> tuple[Model, dict]:
    """A model of `config`'s architecture (an HF config.json dict) with random weights
    (`repeat_layers`: fast, for benchmarks; see `RandomWeightReader`; quantization,
    split_layers, sharder and mtp as in `load_model`)."""
    from metrale_jax.loading.random_weights import RandomWeightReader

    cfg = ModelConfig.from_hf(config)
    fam_name, fam = family_for(cfg.architecture)
    cfg = fam.adapt_config(cfg)
    params = fam.load_params(cfg, RandomWeightReader(dtype, seed=seed, scale=scale, repeat_layers=repeat_layers,
                                                    quantize_fp8=_check_quantization(quantization),
                                                    quantize_w4=_w4_quantization(quantization),
                                                    split_layers=split_layers, sharder=sharder))
    if mtp:
        params["mtp"] = _load_mtp(fam, cfg, RandomWeightReader(dtype, seed=seed + 1, scale=scale,
                                                               repeat_layers=repeat_layers), split_layers)
    model = Model(cfg=cfg, family_name=fam_name, dtype=dtype, name=f"random-{cfg.architecture}",
                  eos_token_ids=tuple(cfg.eos_token_ids), quantization=quantization)
    return model, params
