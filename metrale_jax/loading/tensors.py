"""Tensor sources: read checkpoint tensors one at a time, as numpy arrays, under Hugging Face names.

`SafetensorsSource` reads `*.safetensors` (single file, sharded with an index, or a folder of
shards); `GGUFSource` reads a llama.cpp GGUF file, renames its tensors to the Hugging Face names,
transposes nothing (GGUF's [ne1, ne0] row-major layout already is HF's [out, in]), dequantizes to
float32 and undoes llama.cpp's Q/K row permutation for llama-architecture files.

Both stream: a tensor is read only when `load(name)` is called. A safetensors tensor comes back
as a read-only view into the file's memory mapping (no copy: loading reads each byte once, from
the page cache, on its way to a cast, a transpose or the device); a GGUF tensor as a fresh array.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import ml_dtypes
import numpy as np

from metrale_jax.errors import CorruptCheckpointError, MissingTensorError, UnsupportedDtypeError


@runtime_checkable
class TensorSource(Protocol):
    """Read-only access to the tensors of one checkpoint."""

    path: Path

    def names(self) -> list[str]:
        """All tensor names, sorted."""
        ...

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape `load(name)` will return (HF layout)."""
        ...

    def dtype(self, name: str) -> np.dtype:
        """The dtype `load(name)` will return."""
        ...

    def load(self, name: str) -> np.ndarray:
        """One tensor (possibly a read-only view into a file mapping: copy before writing to it)."""
        ...

    def close(self) -> None: ...


def _missing(name: str, path: Path, known: Iterable[str]) -> MissingTensorError:
    known = list(known)
    # Suggest the closest names so a typo or a wrong prefix is obvious.
    import difflib

    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    hint = f"; similar names: {close}" if close else ""
    return MissingTensorError(f"tensor {name!r} not found in checkpoint {path} ({len(known)} tensors){hint}")


# ================================================================================================
# safetensors
# ================================================================================================

# safetensors dtype string -> (numpy dtype, bytes per element). Anything else is unsupported.
_ST_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}

_MAX_HEADER = 100 * 1024 * 1024  # the limit the safetensors library enforces


class _StFile:
    """One .safetensors file: its parsed header and (lazily) a read-only memory mapping."""

    def __init__(self, path: Path):
        self.path = path
        self._map: mmap.mmap | None = None
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise CorruptCheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
                (n,) = struct.unpack("<Q", head)
                if n > size - 8:
                    raise CorruptCheckpointError(
                        f"{path}: truncated or corrupt safetensors file: header length {n} runs past the end "
                        f"of the file ({size} bytes)"
                    )
                if n > _MAX_HEADER:
                    raise CorruptCheckpointError(f"{path}: corrupt safetensors header (claims {n} bytes)")
                raw = f.read(n)
        except FileNotFoundError as e:
            raise CorruptCheckpointError(f"safetensors file {path} is missing") from e
        try:
            header = json.loads(raw)
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
        except (ValueError, UnicodeDecodeError) as e:
            raise CorruptCheckpointError(f"{path}: corrupt safetensors header: {e}") from e
        self.data_start = 8 + n
        self.metadata = header.pop("__metadata__", None) or {}
        self.entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}  # name -> dtype, shape, begin, end
        data_len = size - self.data_start
        for name, info in header.items():
            try:
                dt, shape, (begin, end) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
                begin, end = int(begin), int(end)
            except (KeyError, TypeError, ValueError) as e:
                raise CorruptCheckpointError(f"{path}: corrupt header entry for tensor {name!r}: {info!r}") from e
            if dt not in _ST_DTYPES:
                raise UnsupportedDtypeError(
                    f"tensor {name!r} in {path} has dtype {dt}, which is not supported "
                    f"(supported: {', '.join(_ST_DTYPES)})"
                )
            if not 0 <= begin <= end or end - begin != int(np.prod(shape, dtype=np.int64)) * _ST_DTYPES[dt].itemsize:
                raise CorruptCheckpointError(
                    f"{path}: corrupt header: tensor {name!r} has data_offsets {[begin, end]} that do not match "
                    f"shape {list(shape)} and dtype {dt}"
                )
            if end > data_len:
                raise CorruptCheckpointError(
                    f"{path}: truncated safetensors file: tensor {name!r} ends at byte {self.data_start + end} "
                    f"but the file has {size} bytes"
                )
            self.entries[name] = (dt, shape, begin, end)

    def load(self, name: str) -> np.ndarray:
        """A read-only view of tensor `name` into the file's mapping, at the offsets the (already
        validated) header gives. The library's `safe_open(...).get_tensor` copies every tensor
        (1.5 GB/s on the dev box) and cannot build the float8 dtypes."""
        dt, shape, begin, end = self.entries[name]
        if self._map is None:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if self.data_start + end > len(self._map):
            raise CorruptCheckpointError(f"{self.path}: truncated while reading tensor {name!r}")
        count = (end - begin) // _ST_DTYPES[dt].itemsize
        return np.frombuffer(self._map, _ST_DTYPES[dt], count, self.data_start + begin).reshape(shape)

    def close(self) -> None:
        # not mmap.close(): arrays still viewing it keep the mapping alive until they are dropped
        self._map = None


class SafetensorsSource:
    """Tensors of a safetensors checkpoint.

    `path` may be a `.safetensors` file, a `model.safetensors.index.json`, or a directory holding
    either `model.safetensors.index.json` (sharded), `model.safetensors`, or any set of
    `*.safetensors` files (their union; a name in two files is an error).

    Headers of all files are read and checked up front (sizes against offsets), so a truncated or
    corrupt file fails at construction with CorruptCheckpointError naming it.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        p = self.path
        index: Path | None = None
        if p.is_dir():
            if (p / "model.safetensors.index.json").is_file():
                index = p / "model.safetensors.index.json"
                files = None
            elif (p / "model.safetensors").is_file():
                files = [p / "model.safetensors"]
            else:
                files = sorted(p.glob("*.safetensors"))
                if not files:
                    raise CorruptCheckpointError(f"no *.safetensors files in {p}")
        elif p.name.endswith(".json"):
            index, files = p, None
        elif p.is_file():
            files = [p]
        else:
            raise CorruptCheckpointError(f"safetensors checkpoint {p} does not exist")

        self._where: dict[str, _StFile] = {}
        self._files: list[_StFile] = []
        if index is not None:
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError("weight_map is not an object")
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CorruptCheckpointError(f"{index}: corrupt safetensors index: {e}") from e
            shard_names = sorted(set(weight_map.values()))
            for s in shard_names:
                if not (index.parent / s).is_file():
                    raise CorruptCheckpointError(
                        f"{index}: the index names shard {s!r}, but {index.parent / s} is missing"
                    )
            by_name = {s: _StFile(index.parent / s) for s in shard_names}
            self._files = list(by_name.values())
            for tname, s in weight_map.items():
                f = by_name[s]
                if tname not in f.entries:
                    raise CorruptCheckpointError(
                        f"{index}: the index puts tensor {tname!r} in {f.path}, but that file lacks it"
                    )
                self._where[tname] = f
            # Tensors present in a shard but not in the index are still served.
            for f in self._files:
                for tname in f.entries:
                    self._where.setdefault(tname, f)
        else:
            assert files is not None
            for fp in files:
                f = _StFile(fp)
                self._files.append(f)
                for tname in f.entries:
                    if tname in self._where:
                        raise CorruptCheckpointError(
                            f"tensor {tname!r} appears in both {self._where[tname].path} and {fp}"
                        )
                    self._where[tname] = f

    def names(self) -> list[str]:
        return sorted(self._where)

    def _entry(self, name: str) -> tuple[_StFile, tuple[str, tuple[int, ...], int, int]]:
        f = self._where.get(name)
        if f is None:
            raise _missing(name, self.path, self._where)
        return f, f.entries[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[1][1]

    def dtype(self, name: str) -> np.dtype:
        return _ST_DTYPES[self._entry(name)[1][0]]

    def load(self, name: str) -> np.ndarray:
        f, _ = self._entry(name)
        return f.load(name)

    def metadata(self) -> dict[str, str]:
        """The `__metadata__` of the first file (e.g. {"format": "pt"})."""
        return dict(self._files[0].metadata) if self._files else {}

    def close(self) -> None:
        for f in self._files:
            f.close()

    def __enter__(self) -> SafetensorsSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ================================================================================================
# GGUF
# ================================================================================================

# llama.cpp tensor names (per block, after "blk.{i}.") -> Hugging Face names (after "model.layers.{i}.")
_GGUF_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.gate",  # the MoE router (qwen3moe, qwen2moe)
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",  # qwen2moe's shared expert and its gate
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# stacked experts [n_expert, out, in] (qwen3moe, qwen2moe) -> each expert's projection, "mlp.experts.{e}.{proj}"
_GGUF_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# llama.cpp writes Mixtral as a "llama" GGUF with experts: HF Mixtral's names for its MoE block
_MIXTRAL_EXPERT_NAMES = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}
_GGUF_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Architectures whose llama.cpp converter permutes q/k rows for interleaved (GPT-J style) RoPE.
_PERMUTED_ARCHS = frozenset({"llama"})
_ARCH_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
}


def gguf_to_hf_name(name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name, or None if it has no HF counterpart."""
    parts = name.split(".")
    if len(parts) == 2 and parts[0] in _GGUF_TOP_NAMES:
        return f"{_GGUF_TOP_NAMES[parts[0]]}.{parts[1]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _GGUF_BLOCK_NAMES:
        return f"model.layers.{int(parts[1])}.{_GGUF_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp's converter reshapes the [n_head * head_dim, ...] rows to (n_head, 2, head_dim/2)
    and swaps the last two axes, so each head's rotary halves become interleaved pairs. This is the
    inverse: (n_head, head_dim/2, 2) -> (n_head, 2, head_dim/2). Works for weights [out, in] and
    biases [out]. For k, pass the KV-head count.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{rows=} is not divisible by 2 * {n_head=}")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's own permutation (HF layout -> GGUF layout); the inverse of `unpermute_qk`."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field_value(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        v = f.contents()
    except Exception as e:  # noqa: BLE001 - a malformed field is a corrupt file
        raise CorruptCheckpointError(f"corrupt GGUF metadata field {key!r}: {e}") from e
    return v


def _f32(v: Any) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(v)))


def open_gguf_reader(path: str | os.PathLike) -> Any:
    """gguf.GGUFReader over `path`, with header errors and truncation mapped to CorruptCheckpointError."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise CorruptCheckpointError(f"GGUF file {path} does not exist")
    size = path.stat().st_size
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as e:  # noqa: BLE001 - GGUFReader raises ValueError/KeyError/IndexError/... on bad bytes
        raise CorruptCheckpointError(f"{path}: truncated or corrupt GGUF file: {type(e).__name__}: {e}") from e
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != t.n_bytes:
            raise CorruptCheckpointError(
                f"{path}: truncated GGUF file: tensor {t.name!r} ends at byte {end} but the file has {size} bytes"
            )
    return reader


@dataclasses.dataclass(frozen=True)
class _Expert:
    """Expert `index` of a GGUF tensor that stacks a layer's experts (`_GGUF_EXPERT_NAMES`)."""

    tensor: Any
    index: int


class GGUFSource:
    """Tensors of a GGUF file under Hugging Face names and shapes, dequantized to float32 at load.

    Tensors with no HF counterpart (for example `rope_freqs.weight`) keep their GGUF names. A
    layer's stacked expert tensors read as each expert's HF tensor (dequantized once a layer).
    Quant types are whatever `gguf.quants.dequantize` implements (F32, F16, BF16, Q4_0, Q4_1,
    Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, IQ*, TQ*, MXFP4, ...); others raise UnsupportedDtypeError.
    """

    def __init__(self, path: str | os.PathLike, reader: Any = None):
        self.path = Path(path)
        self.reader = reader if reader is not None else open_gguf_reader(self.path)
        self.arch = str(_field_value(self.reader, "general.architecture", "llama"))
        self._tensors: dict[str, Any] = {}  # HF name -> gguf ReaderTensor, or an _Expert of one
        self._stacked: dict[str, np.ndarray] = {}  # the last dequantized stacked expert tensors
        mixtral = self.arch == "llama"  # (its MoE tensors, if any, are Mixtral's)
        for t in self.reader.tensors:
            parts = t.name.split(".")
            if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_EXPERT_NAMES and parts[1].isdigit():
                block, proj = ("block_sparse_moe", _MIXTRAL_EXPERT_NAMES[parts[2]]) if mixtral else \
                    ("mlp", _GGUF_EXPERT_NAMES[parts[2]])
                p = f"model.layers.{int(parts[1])}.{block}.experts.{{}}.{proj}.{parts[3]}"
                entries = {p.format(e): _Expert(t, e) for e in range(int(t.shape.tolist()[-1]))}
            else:
                hf = gguf_to_hf_name(t.name) or t.name
                if mixtral and len(parts) == 4 and parts[2] == "ffn_gate_inp":
                    hf = hf.replace(".mlp.gate.", ".block_sparse_moe.gate.")
                entries = {hf: t}
            for hf, entry in entries.items():
                if hf in self._tensors:
                    raise CorruptCheckpointError(f"{self.path}: two tensors map to {hf!r}")
                self._tensors[hf] = entry
        self.n_head = self._meta_int("attention.head_count")
        self.n_kv_head = self._meta_int("attention.head_count_kv", self.n_head)

    # ---- metadata -----------------------------------------------------------------------------
    def meta(self, key: str, default: Any = None) -> Any:
        """A metadata value by full key (e.g. "llama.block_count", "tokenizer.ggml.bos_token_id")."""
        return _field_value(self.reader, key, default)

    def _meta_int(self, key: str, default: int | None = None) -> int | None:
        v = self.meta(f"{self.arch}.{key}", default)
        if isinstance(v, list):  # per-layer arrays (some hybrids); uniform ones collapse to one value
            if len(set(v)) != 1:
                raise UnsupportedDtypeError(f"{self.path}: per-layer {self.arch}.{key}={v} is not supported")
            v = v[0]
        return None if v is None else int(v)

    def hf_config(self) -> dict:
        """An HF-style config.json dict built from the `{arch}.*` metadata."""
        a = self.arch
        m = lambda k, d=None: self.meta(f"{a}.{k}", d)  # noqa: E731
        hidden = int(m("embedding_length"))
        n_head = int(self.n_head or 0)
        vocab = m("vocab_size")
        if vocab is None:
            tokens = self.reader.fields.get("tokenizer.ggml.tokens")
            vocab = len(tokens.data) if tokens is not None else self.shape("model.embed_tokens.weight")[0]
        cfg: dict[str, Any] = {
            "architectures": [_ARCH_CLASSES.get(a, f"{a.capitalize()}ForCausalLM")],
            "model_type": a,
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(m("feed_forward_length", 4 * hidden)),
            "num_hidden_layers": int(m("block_count")),
            "num_attention_heads": n_head,
            "num_key_value_heads": int(self.n_kv_head or n_head),
            "rms_norm_eps": _f32(m("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": _f32(m("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(m("context_length", 4096)),
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        head_dim = m("attention.key_length")
        if head_dim is not None:
            cfg["head_dim"] = int(head_dim)
        elif n_head and hidden % n_head == 0:
            cfg["head_dim"] = hidden // n_head
        if "model.layers.0.self_attn.q_proj.bias" in self._tensors:
            cfg["attention_bias"] = True
        if m("expert_count") is not None and a == "llama":  # Mixtral (its experts feed_forward_length wide)
            cfg.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=int(
                m("expert_count")), num_experts_per_tok=int(m("expert_used_count")))
            if m("expert_feed_forward_length") is not None:
                cfg["intermediate_size"] = int(m("expert_feed_forward_length"))
        elif m("expert_count") is not None:  # qwen3moe / qwen2moe (llama.cpp renormalizes qwen3moe's top-k weights)
            cfg.update(num_experts=int(m("expert_count")), num_experts_per_tok=int(m("expert_used_count")),
                       moe_intermediate_size=int(m("expert_feed_forward_length")), norm_topk_prob=a == "qwen3moe")
            if m("expert_shared_feed_forward_length") is not None:
                cfg["shared_expert_intermediate_size"] = int(m("expert_shared_feed_forward_length"))
        kind = m("rope.scaling.type")
        if kind and kind != "none":
            sc: dict[str, Any] = {"rope_type": str(kind), "factor": _f32(m("rope.scaling.factor", 1.0))}
            orig = m("rope.scaling.original_context_length")
            if orig is not None:
                sc["original_max_position_embeddings"] = int(orig)
            cfg["rope_scaling"] = sc
        for key, hf in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                        ("padding_token_id", "pad_token_id")):
            v = self.meta(f"tokenizer.ggml.{key}")
            if v is not None:
                cfg[hf] = int(v)
        return cfg

    # ---- tensors ------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self._tensors)

    def _get(self, name: str) -> Any:
        t = self._tensors.get(name)
        if t is None:
            raise _missing(name, self.path, self._tensors)
        return t

    def _tensor(self, name: str) -> Any:
        """The gguf ReaderTensor holding `name` (an expert's: the layer's stacked tensor)."""
        t = self._get(name)
        return t.tensor if isinstance(t, _Expert) else t

    def shape(self, name: str) -> tuple[int, ...]:
        # GGUF dims are [ne0, ne1, ...] with ne0 fastest; HF/numpy order is the reverse.
        t = self._get(name)
        dims = tuple(int(d) for d in reversed(self._tensor(name).shape.tolist()))
        return dims[1:] if isinstance(t, _Expert) else dims

    def dtype(self, name: str) -> np.dtype:
        from gguf import GGMLQuantizationType as Q

        t = self._tensor(name)
        ints = {Q.I8: np.int8, Q.I16: np.int16, Q.I32: np.int32, Q.I64: np.int64}
        return np.dtype(ints.get(t.tensor_type, np.float32))

    def quant_type(self, name: str) -> str:
        """The GGML type name of the stored tensor ("Q4_1", "F32", ...)."""
        return self._tensor(name).tensor_type.name

    def load(self, name: str) -> np.ndarray:
        t = self._get(name)
        if isinstance(t, _Expert):
            stacked = self._stacked.get(t.tensor.name)
            if stacked is None:  # (the family reads a layer's experts in turn: keep its three tensors)
                stacked = self._dequantize(t.tensor, name, (int(t.tensor.shape.tolist()[-1]), *self.shape(name)))
                self._stacked = {k: v for k, v in list(self._stacked.items())[-2:]} | {t.tensor.name: stacked}
            return stacked[t.index]
        out = self._dequantize(t, name, self.shape(name))
        if self.arch in _PERMUTED_ARCHS:
            if ".self_attn.q_proj." in name:
                out = unpermute_qk(out, int(self.n_head))
            elif ".self_attn.k_proj." in name:
                out = unpermute_qk(out, int(self.n_kv_head))
        return out

    def _dequantize(self, t: Any, name: str, shape: tuple[int, ...]) -> np.ndarray:
        import gguf
        from gguf import GGMLQuantizationType as Q

        qt = t.tensor_type
        try:
            if qt in (Q.I8, Q.I16, Q.I32, Q.I64):
                out = np.array(t.data, dtype=self.dtype(name))
            elif qt == Q.F64:
                out = np.asarray(t.data, dtype=np.float32)
            elif qt == Q.F32:
                out = np.array(t.data, dtype=np.float32)
            else:
                try:
                    out = gguf.quants.dequantize(t.data, qt)
                except NotImplementedError as e:
                    raise UnsupportedDtypeError(
                        f"tensor {t.name!r} ({name}) in {self.path} has quant type {qt.name}, which "
                        f"gguf.quants cannot dequantize"
                    ) from e
                out = np.asarray(out, dtype=np.float32)
        except (ValueError, IndexError, OSError) as e:
            raise CorruptCheckpointError(f"{self.path}: could not read tensor {t.name!r}: {e}") from e
        return out.reshape(shape)

    def close(self) -> None:
        # GGUFReader holds a np.memmap; dropping our references lets it be unmapped.
        self._tensors, self._stacked = {}, {}
        self.reader = None

    def __enter__(self) -> GGUFSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
