"""4-bit weights: GPTQ, AWQ, compressed-tensors W4A16 and NVFP4 checkpoints, read into one layout.

Every format is read here (numpy, load time) into one canonical host form, `W4Weight`:
    packed u8[N, ceil(K/2)] 4-bit codes along K, two per byte (code 2j in the low nibble of byte j),
                         in the weight's K order (see `perm`); `codes` unpacks them, u8[N, K]
    scales [N, ceil(K/G)] group scales along K (f16 | bf16 | f32 for integer codes, float8_e4m3fn for FP4)
    zeros  u8[N, ceil(K/G)] integer zero points (0..16) of integer codes; None for FP4
    perm   i32[K] | None  the input column each weight column reads (GPTQ act-order), None = identity
    row_scale float | None FP4's per-tensor global scale (a multiplier), None = 1
and W[n, perm[k]] = (codes[n, k] - zeros[n, k // G]) * scales[n, k // G]        (kind "int4")
               or = e2m1(codes[n, k]) * scales[n, k // G] * row_scale            (kind "fp4").
`layers.linear.W4Linear` stacks these bytes for the device as they are. GPTQ's and
compressed-tensors' int32 words and NVFP4's bytes already hold the codes in this order (little-endian
words: code 8w + j in bits 4j..4j+3 of word w, i.e. code 2j in the low nibble of byte j), so they are
kept as bytes, not unpacked: only an act-order permutation or AWQ's interleaved columns move codes
(a Llama-3-8B gate projection read in 0.03 s instead of 0.64 on the dev box).

The checkpoint formats (what each reader below undoes):
* GPTQ (AutoGPTQ / GPTQModel, `quant_method: "gptq"`): `qweight` i32[K/8, N], code k of column n in
  bits 4*(k % 8) of word k // 8; `qzeros` i32[n_groups, N/8], packed along N the same way;
  `scales` f16[n_groups, N]; `g_idx` i32[K], the group of each input column (act-order,
  `desc_act: true`, shuffles it). W = (q - z) * s where the stored zero is z - 1 (the v1
  "checkpoint_format": "gptq" convention; "gptq_v2" stores z itself). `group_size: -1`: one group.
* AWQ (AutoAWQ, `quant_method: "awq"`, `version: "gemm"`): `qweight` i32[K, N/8], nibble i of word
  c holding column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]; `qzeros` i32[n_groups, N/8] packed alike
  (no offset); `scales` f16[n_groups, N]. W = (q - z) * s.
* compressed-tensors `pack-quantized` (llm-compressor W4A16): `weight_packed` i32[N, ceil(K/8)],
  code k in bits 4*(k % 8) of word k // 8, stored as signed value + 8; `weight_scale` [N, n_groups]
  (strategy "group") or [N, 1] ("channel"); `weight_zero_point` (asymmetric only) i32[ceil(N/8),
  n_groups], packed along N, signed + 8; `weight_shape` [2] = (N, K); optional `weight_g_idx`.
  W = (q - z) * s with the +8 offsets cancelling (symmetric: z = 8).
* NVFP4, compressed-tensors `nvfp4-pack-quantized`: `weight_packed` u8[N, K/2] (element 2i in the
  low nibble), e2m1 codes (bit 3 the sign, magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6);
  `weight_scale` float8_e4m3fn[N, K/16]; `weight_global_scale` f32[1] a DIVISOR:
  W = e2m1 * weight_scale / weight_global_scale.
* NVFP4, NVIDIA ModelOpt (`quant_method: "modelopt"`, `quant_algo: "NVFP4"`): `weight` u8[N, K/2]
  packed the same way, `weight_scale` float8_e4m3fn[N, K/16], `weight_scale_2` f32[] a MULTIPLIER:
  W = e2m1 * weight_scale * weight_scale_2. (`input_scale`: activations stay bf16 here, unused.)

Quantize-on-load (`quantize_int4`: asymmetric round-to-nearest, group 128; `quantize_nvfp4`: the
ModelOpt recipe) produces the same `W4Weight`; its arithmetic runs jitted on JAX's default device
(numpy took 1.6 / 8.2 s for one 4,096 x 14,336 matrix on the dev box, XLA's CPU backend 0.2 /
0.3 s), with numpy's rounding (`quant.fp8.exact_div`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from metrale_jax.errors import CorruptCheckpointError, MissingTensorError, TensorShapeError, UnsupportedDtypeError
from metrale_jax.quant.fp8 import MODELOPT_FP8, exact_div

FP4_GROUP = 16  # NVFP4's scale block (elements along K)
INT4_GROUP = 128  # quantize_int4's group
# e2m1 code (0..15, bit 3 = sign) -> value
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       np.float32)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8c + AWQ_ORDER[i]
F8 = np.dtype(ml_dtypes.float8_e4m3fn)
_INT_SCALE_DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32))


@dataclass(frozen=True)
class W4Scheme:
    """What config.json's quantization_config says about 4-bit weights (see `parse_w4_config`).

    method: "gptq" | "awq" | "compressed-tensors" | "nvfp4-ct" | "modelopt".
    group_size: elements per scale along K (None: read from the tensors, e.g. CT "channel").
    gptq_v1: GPTQ stores zero - 1 (checkpoint_format "gptq"); False for "gptq_v2".
    act_order: GPTQ `desc_act`: every linear must carry its g_idx.
    zero_points: compressed-tensors W4A16 not `symmetric`: every linear must carry its weight_zero_point
        (None: config groups that differ, so each linear's own tensors say).
    group_sizes: compressed-tensors config groups with different group sizes: the sizes declared,
        one of which each linear's scales fit (`ct_scales`).
    """

    method: str
    group_size: int | None = None
    gptq_v1: bool = True
    act_order: bool = False
    zero_points: bool | None = False
    group_sizes: tuple[int, ...] = ()


@dataclass
class W4Weight:
    """One linear's 4-bit weight in the canonical host form (module docstring)."""

    kind: str  # "int4" | "fp4"
    packed: np.ndarray  # u8[N, ceil(K / 2)]
    scales: np.ndarray  # [N, ceil(K / group_size)]
    zeros: np.ndarray | None  # u8[N, ceil(K / group_size)] (int4)
    group_size: int
    perm: np.ndarray | None = None  # i32[K]
    row_scale: float | None = None  # fp4 global multiplier
    k: int = 0  # K (0: 2 * the packed row's bytes)

    def __post_init__(self):
        self.k = self.k or 2 * self.packed.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.k

    @property
    def codes(self) -> np.ndarray:
        """u8[N, K]: one code per weight."""
        return unpack_nibbles(self.packed)[:, : self.k]


def e2m1_to_float(codes: np.ndarray) -> np.ndarray:
    return E2M1_VALUES[np.asarray(codes, np.uint8) & 15]


def dequantize_w4(w: W4Weight) -> np.ndarray:
    """-> f32[N, K] in the checkpoint's input-column order (the perm undone)."""
    codes = w.codes
    n, k = codes.shape
    s = np.repeat(w.scales.astype(np.float32), w.group_size, axis=1)[:, :k]
    if w.kind == "int4":
        z = np.repeat(w.zeros.astype(np.float32), w.group_size, axis=1)[:, :k]
        out = (codes.astype(np.float32) - z) * s
    else:
        out = e2m1_to_float(codes) * s * np.float32(1.0 if w.row_scale is None else w.row_scale)
    if w.perm is not None:
        full = np.empty_like(out)
        full[:, w.perm] = out
        out = full
    return out


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """u8[..., K] codes 0..15 -> u8[..., ceil(K/2)]: byte j = codes[2j] | codes[2j+1] << 4 (odd K: a 0 pad)."""
    codes = np.asarray(codes, np.uint8)
    if codes.shape[-1] % 2:
        codes = np.concatenate([codes, np.zeros(codes.shape[:-1] + (1,), np.uint8)], axis=-1)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """u8[..., B] -> u8[..., 2B]: `pack_nibbles` undone."""
    out = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), np.uint8)
    out[..., 0::2] = packed & 15
    out[..., 1::2] = packed >> 4
    return out


def word_bytes(words: np.ndarray, count: int) -> np.ndarray:
    """u32[..., W] -> their first `count` little-endian bytes u8[..., count]: 4-bit codes along K
    (code 8w + j in bits 4j.. of word w) packed two per byte (count = ceil(K/2)), or 8-bit codes
    one per byte (count = K)."""
    return np.ascontiguousarray(words, dtype="<u4").view(np.uint8)[..., :count]


def _transposed(a: np.ndarray) -> np.ndarray:
    """A new contiguous a.T (`WeightReader.transposed`: in bands, on threads)."""
    from metrale_jax.loading.weights import WeightReader

    return WeightReader.transposed(a)


def _permuted(packed: np.ndarray, perm: np.ndarray | None, k: int) -> np.ndarray:
    """packed u8[N, ceil(K/2)] with its codes' columns reordered by perm (act-order), or as is."""
    return packed if perm is None else pack_nibbles(np.ascontiguousarray(unpack_nibbles(packed)[:, :k][:, perm]))


# ---- config -----------------------------------------------------------------------------------------
def _err(msg: str) -> UnsupportedDtypeError:
    return UnsupportedDtypeError(f"quantization_config: {msg}")


def parse_group(g, what: str) -> int | None:
    if g is None:
        return None
    try:
        g = int(g)
    except (TypeError, ValueError) as e:
        raise _err(f"{what} group_size {g!r} is not an integer") from e
    if g == -1:
        return None  # one group over K (per output channel)
    if g < 2 or g % 2:
        raise _err(f"{what} group_size {g} is not supported (an even number >= 2, or -1)")
    return g


def _bits(qc: Mapping, key: str, what: str) -> None:
    if key not in qc:  # (vLLM refuses it too: the codes' width is not guessed)
        raise _err(f"{what} config has no {key!r} (the weights' bit width)")
    bits = qc[key]
    if bits != 4:
        raise _err(f"{what} with {bits}-bit weights is not supported "
                   f"({'4-bit or 8-bit' if what == 'GPTQ' else '4-bit'} only)")


def gptq_v1(qc: Mapping) -> bool:
    """Whether a GPTQ config (4- or 8-bit) stores zero - 1 (checkpoint_format "gptq") rather than the
    zero ("gptq_v2"); UnsupportedDtypeError for another format (Marlin, BitBLAS) and for
    GPTQModel `dynamic` rules we cannot run (`_check_gptq_dynamic`)."""
    _check_gptq_dynamic(qc)
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _err(f"GPTQ checkpoint_format {fmt!r} is not supported ('gptq' or 'gptq_v2'; "
                   "Marlin / BitBLAS repacked checkpoints are not)")
    return fmt == "gptq"


def _check_gptq_dynamic(qc: Mapping) -> None:
    """GPTQModel's `dynamic` rules (a module-name regex -> overrides; "-:" skips the module, which
    then stays unquantized in the checkpoint and loads as it is): a rule that gives its modules
    another bit width or group size than the config's is refused, naming the rule."""
    rules = qc.get("dynamic") or {}
    if not isinstance(rules, Mapping):
        raise _err(f"GPTQ dynamic must be a mapping of module patterns to overrides; got {type(rules).__name__}")
    for pattern, over in rules.items():
        if str(pattern).startswith("-:"):
            continue
        if not isinstance(over, Mapping):
            raise _err(f"GPTQ dynamic rule {pattern!r}: overrides must be a mapping; got {type(over).__name__}")
        for key, top in (("bits", qc.get("bits")), ("group_size", qc.get("group_size", 128))):
            if key not in over:
                continue
            same = parse_group(over[key], "GPTQ dynamic") == parse_group(top, "GPTQ") if key == "group_size" \
                else over[key] == top
            if not same:
                raise _err(f"GPTQ dynamic rule {pattern!r} sets {key} {over[key]!r} where the config has {top!r}; "
                           "per-module bit widths and group sizes are not supported")


def parse_w4_config(qc: Mapping) -> W4Scheme | None:
    """The 4-bit scheme of a quantization_config, None if it is not a 4-bit method (FP8 is checked
    elsewhere); UnsupportedDtypeError naming the field for a variant we cannot run."""
    if not isinstance(qc, Mapping):
        raise _err(f"must be a mapping; got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "gptq":
        _bits(qc, "bits", "GPTQ")
        return W4Scheme("gptq", parse_group(qc.get("group_size", 128), "GPTQ"), gptq_v1=gptq_v1(qc),
                        act_order=bool(qc.get("desc_act", False)))
    if method == "awq":
        _bits(qc, "bits" if "bits" in qc else "w_bit", "AWQ")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise _err(f"AWQ version {version!r} is not supported (only 'gemm' packing)")
        if qc.get("zero_point", True) is False:
            raise _err("AWQ without zero points is not supported")
        return W4Scheme("awq", parse_group(qc.get("group_size", qc.get("q_group_size", 128)), "AWQ"))
    if method == "compressed-tensors":
        return _parse_ct(qc)
    if method == "modelopt":
        inner = qc.get("quantization", qc)
        algo = inner.get("quant_algo")
        if algo in MODELOPT_FP8:
            return None  # FP8 (quant.fp8.check_fp8_quantization_config)
        if algo != "NVFP4":
            raise _err(f"ModelOpt quant_algo {algo!r} is not supported ('NVFP4', {', '.join(map(repr, MODELOPT_FP8))})")
        g = int(inner.get("group_size", FP4_GROUP))
        if g != FP4_GROUP:
            raise _err(f"ModelOpt NVFP4 group_size {g} is not supported (only {FP4_GROUP})")
        return W4Scheme("modelopt", FP4_GROUP)
    return None


def _parse_ct(qc: Mapping) -> W4Scheme | None:
    fmt = qc.get("format")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise _err("compressed-tensors config has no config_groups")
    fp8 = [g.get("format", fmt) == "float-quantized" for g in groups.values()]
    if all(fp8):
        return None  # FP8 (quant.fp8.check_fp8_quantization_config)
    if any(fp8):
        raise _err("compressed-tensors config_groups mixing FP8 and 4-bit weights are not supported")
    schemes = []
    for name, g in groups.items():
        w = g.get("weights") or {}
        fmt_g = g.get("format", fmt)
        if fmt_g not in ("pack-quantized", "nvfp4-pack-quantized"):
            raise _err(f"compressed-tensors format {fmt_g!r} ({name}) is not supported "
                       "('pack-quantized' W4A16 / W8A16, 'int-quantized' or 'nvfp4-pack-quantized')")
        if w.get("num_bits") != 4:
            raise _err(f"compressed-tensors {name}: {w.get('num_bits')}-bit pack-quantized weights are not supported "
                       "(4-bit or 8-bit)")
        if w.get("dynamic"):
            raise _err(f"compressed-tensors {name}: dynamic weight quantization is not supported")
        act = g.get("input_activations")
        if fmt_g == "pack-quantized":
            if w.get("type", "int") != "int":
                raise _err(f"compressed-tensors {name}: pack-quantized {w.get('type')!r} weights are not supported")
            if act is not None:
                raise _err(f"compressed-tensors {name}: quantized activations (W4A{act.get('num_bits')}) are not "
                           "supported; only W4A16")
            strategy = w.get("strategy")
            zp = not w.get("symmetric", True)
            if strategy == "group":
                schemes.append(W4Scheme("compressed-tensors", parse_group(w.get("group_size"), "compressed-tensors"),
                                        zero_points=zp))
            elif strategy == "channel":
                schemes.append(W4Scheme("compressed-tensors", None, zero_points=zp))
            else:
                raise _err(f"compressed-tensors {name}: weight strategy {strategy!r} is not supported "
                           "('group' or 'channel')")
        else:
            if w.get("type") != "float" or w.get("group_size") != FP4_GROUP:
                raise _err(f"compressed-tensors {name}: nvfp4-pack-quantized needs float 4-bit weights in groups "
                           f"of {FP4_GROUP}")
            if not w.get("symmetric", True):
                raise _err(f"compressed-tensors {name}: asymmetric NVFP4 is not supported")
            schemes.append(W4Scheme("nvfp4-ct", FP4_GROUP))  # activations (W4A4) run in bf16: weight-only
    if len({s.method for s in schemes}) > 1:
        raise _err("compressed-tensors config_groups mixing W4A16 and NVFP4 are not supported")
    if len(set(schemes)) == 1:  # (one group, or several with the same scheme and other targets)
        return schemes[0]
    # Groups that differ: each module's group size is the declared one its scales fit (`ct_scales`),
    # its zero points are there or not (symmetric groups beside asymmetric ones)
    sizes = tuple(sorted({s.group_size for s in schemes if s.group_size is not None}))
    zps = {s.zero_points for s in schemes}
    return W4Scheme(schemes[0].method, sizes[0] if len(sizes) == 1 and None not in {s.group_size for s in schemes}
                    else None, zero_points=zps.pop() if len(zps) == 1 else None, group_sizes=sizes)


# ---- readers ----------------------------------------------------------------------------------------
def u32_words(a: np.ndarray, name: str) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype not in (np.dtype(np.int32), np.dtype(np.uint32)):
        raise UnsupportedDtypeError(f"{name}: packed weights must be int32; got {a.dtype}")
    return a.view(np.uint32)


def _nibbles_along_last(words: np.ndarray) -> np.ndarray:
    """u32[..., W] -> u8[..., 8W]: element 8w + j = bits 4j..4j+3 of word w."""
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    return ((words[..., None] >> shifts) & 15).astype(np.uint8).reshape(words.shape[:-1] + (-1,))


def check_shape(a, want: tuple[int, ...], name: str) -> None:
    if tuple(a.shape) != tuple(want):
        raise TensorShapeError(f"{name}: shape {tuple(a.shape)}, expected {tuple(want)}")


def int_scales(s, name: str) -> np.ndarray:
    s = np.asarray(s)
    if s.dtype not in _INT_SCALE_DTYPES:
        raise UnsupportedDtypeError(f"{name}: scale dtype {s.dtype} is not supported (float16, bfloat16, float32)")
    if not np.all(np.isfinite(s.astype(np.float32))):
        raise CorruptCheckpointError(f"{name}: scales must be finite")
    return s


def act_order(g_idx, k: int, g: int, name: str) -> np.ndarray | None:
    """g_idx i32[K] -> the permutation putting each group's columns together (None if trivial).
    GPTQ's act-order shuffles which columns form a group, but every group keeps g columns."""
    g_idx = np.asarray(g_idx).astype(np.int64)
    check_shape(g_idx, (k,), name)
    trivial = np.arange(k) // g
    if np.array_equal(g_idx, trivial):
        return None
    perm = np.argsort(g_idx, kind="stable").astype(np.int32)
    if not np.array_equal(g_idx[perm], trivial):
        raise UnsupportedDtypeError(f"{name}: groups of unequal size (each group must hold {g} columns)")
    return perm


def read_gptq(load, prefix: str, n: int, k: int, scheme: W4Scheme) -> W4Weight:
    """load(name) -> array; prefix "model.layers.0.self_attn.q_proj."; W [N, K]."""
    g = scheme.group_size or k
    ng = -(-k // g)
    qw = u32_words(load(prefix + "qweight"), prefix + "qweight")
    check_shape(qw, (-(-k // 8), n), prefix + "qweight")
    qz = u32_words(load(prefix + "qzeros"), prefix + "qzeros")
    check_shape(qz, (ng, -(-n // 8)), prefix + "qzeros")
    zeros = _nibbles_along_last(qz)[:, :n].T.astype(np.uint8)  # u8[N, ng]
    if scheme.gptq_v1:
        zeros = zeros + np.uint8(1)
    s = int_scales(load(prefix + "scales"), prefix + "scales")
    check_shape(s, (ng, n), prefix + "scales")
    perm = None
    if scheme.act_order and not load.has(prefix + "g_idx"):  # (without it the columns' groups are unknown)
        raise MissingTensorError(f"tensor {prefix + 'g_idx'!r} is missing: the GPTQ config has desc_act true "
                                 "(act-order), so each linear needs its g_idx")
    g_idx = load(prefix + "g_idx") if load.has(prefix + "g_idx") else None
    if g_idx is not None:
        perm = act_order(g_idx, k, g, prefix + "g_idx")
    packed = _permuted(word_bytes(_transposed(qw), -(-k // 2)), perm, k)
    return W4Weight("int4", packed, np.ascontiguousarray(s.T), zeros, g, perm, k=k)


def read_awq(load, prefix: str, n: int, k: int, scheme: W4Scheme) -> W4Weight:
    g = scheme.group_size or k
    ng = -(-k // g)
    inv = np.argsort(AWQ_ORDER)  # column j of a word sits in nibble inv[j]

    def unpack(a, rows, name):
        a = u32_words(a, name)
        check_shape(a, (rows, -(-n // 8)), name)
        nib = unpack_nibbles(np.ascontiguousarray(a, dtype="<u4").view(np.uint8)).reshape(rows, -1, 8)
        return nib[:, :, inv].reshape(rows, -1)[:, :n]  # [rows, N] in column order (nibble i: 8c + ORDER[i])

    qw = u32_words(load(prefix + "qweight"), prefix + "qweight")
    check_shape(qw, (k, -(-n // 8)), prefix + "qweight")
    b = np.ascontiguousarray(qw, dtype="<u4").view(np.uint8).reshape(k, -1, 4)  # [K, N/8, byte of the word]
    if k % 2:
        b = np.concatenate([b, np.zeros((1,) + b.shape[1:], np.uint8)])
    pairs = np.empty((b.shape[0] // 2, b.shape[1], 8), np.uint8)  # [K/2, N/8, column 8c + j]
    for j, nib in enumerate((b & 15, b >> 4)):  # nibbles 2i + j of the words: columns 8c + AWQ_ORDER[2i + j]
        pairs[:, :, list(AWQ_ORDER[j::2])] = nib[0::2] | (nib[1::2] << 4)  # rows 2r, 2r + 1 in one byte
    packed = _transposed(pairs.reshape(pairs.shape[0], -1)[:, :n])  # u8[N, K/2]
    zeros = np.ascontiguousarray(unpack(load(prefix + "qzeros"), ng, prefix + "qzeros").T)
    s = int_scales(load(prefix + "scales"), prefix + "scales")
    check_shape(s, (ng, n), prefix + "scales")
    return W4Weight("int4", packed, np.ascontiguousarray(s.T), zeros, g, k=k)


def ct_scales(load, prefix: str, n: int, k: int, group_size: int | None,
              group_sizes: tuple[int, ...] = ()) -> tuple[np.ndarray, int]:
    """(compressed-tensors' `weight_scale` as [N, n_groups], the group size): a scale per group
    ([N, n_groups]), per channel ([N, 1] or [N]) or per tensor ([] or [1], then one per row).
    group_size None: the one of `group_sizes` (config groups that differ) these scales fit."""
    s = int_scales(load(prefix + "weight_scale"), prefix + "weight_scale")
    if s.size == 1:
        s = np.full((n, 1), s.reshape(-1)[0], s.dtype)
    elif s.ndim == 1:
        s = s.reshape(-1, 1)
    if s.ndim != 2 or s.shape[0] != n:
        raise TensorShapeError(f"{prefix}weight_scale: shape {s.shape}, expected [{n}, groups], [{n}, 1] or [1]")
    ng = s.shape[1]
    if ng == 1 or group_size:
        g = k if ng == 1 else group_size
    else:
        fits = [c for c in group_sizes if -(-k // c) == ng]
        if len(fits) != 1:
            raise TensorShapeError(f"{prefix}weight_scale: {ng} groups along K={k} fit "
                                   f"{'none' if not fits else 'more than one'} of the config's group sizes "
                                   f"{list(group_sizes)}")
        g = fits[0]
    if -(-k // g) != ng:
        raise TensorShapeError(f"{prefix}weight_scale: {ng} groups do not fit K={k} in groups of {g}")
    return s, g


def read_ct_int4(load, prefix: str, n: int, k: int, scheme: W4Scheme) -> W4Weight:
    shape = tuple(int(d) for d in np.asarray(load(prefix + "weight_shape")).reshape(-1))
    if shape != (n, k):
        raise TensorShapeError(f"{prefix}weight_shape: {shape}, expected {(n, k)} from the config")
    words = u32_words(load(prefix + "weight_packed"), prefix + "weight_packed")
    check_shape(words, (n, -(-k // 8)), prefix + "weight_packed")
    s, g = ct_scales(load, prefix, n, k, scheme.group_size, scheme.group_sizes)
    ng = s.shape[1]
    if scheme.zero_points and not load.has(prefix + "weight_zero_point"):
        raise MissingTensorError(f"tensor {prefix + 'weight_zero_point'!r} is missing: the compressed-tensors "
                                 "config is asymmetric (symmetric: false)")
    if load.has(prefix + "weight_zero_point"):
        zp = u32_words(load(prefix + "weight_zero_point"), prefix + "weight_zero_point")
        check_shape(zp, (-(-n // 8), ng), prefix + "weight_zero_point")
        zeros = np.ascontiguousarray(_nibbles_along_last(zp.T)[:, :n].T)  # packed along N
    else:
        zeros = np.full((n, ng), 8, np.uint8)
    perm = None
    if load.has(prefix + "weight_g_idx"):
        perm = act_order(load(prefix + "weight_g_idx"), k, g, prefix + "weight_g_idx")
    return W4Weight("int4", _permuted(word_bytes(words, -(-k // 2)), perm, k), s, zeros, g, perm, k=k)


def _fp4(load, packed_name: str, scale_name: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(packed u8[N, K/2], scales float8_e4m3fn[N, K/16]): NVFP4's bytes are `W4Weight.packed` already."""
    if k % FP4_GROUP:
        raise TensorShapeError(f"{packed_name}: NVFP4 needs K % {FP4_GROUP} == 0; got K={k}")
    p = np.asarray(load(packed_name))
    if p.dtype != np.uint8:
        raise UnsupportedDtypeError(f"{packed_name}: NVFP4 weights must be uint8 (two e2m1 per byte); got {p.dtype}")
    check_shape(p, (n, k // 2), packed_name)
    s = np.asarray(load(scale_name))
    if s.dtype != F8:
        raise UnsupportedDtypeError(f"{scale_name}: NVFP4 scales must be float8_e4m3fn; got {s.dtype}")
    check_shape(s, (n, k // FP4_GROUP), scale_name)
    return p, s


def _global(v, name: str) -> float:
    v = np.asarray(v, np.float32).reshape(-1)
    if v.size != 1 or not np.isfinite(v[0]) or v[0] <= 0:
        raise CorruptCheckpointError(f"{name}: a single finite positive global scale expected; got {v[:4]}")
    return float(v[0])


def read_nvfp4_ct(load, prefix: str, n: int, k: int, scheme: W4Scheme) -> W4Weight:
    packed, s = _fp4(load, prefix + "weight_packed", prefix + "weight_scale", n, k)
    gs = _global(load(prefix + "weight_global_scale"), prefix + "weight_global_scale")
    return W4Weight("fp4", packed, s, None, FP4_GROUP, row_scale=float(np.float32(1.0) / np.float32(gs)))


def read_modelopt(load, prefix: str, n: int, k: int, scheme: W4Scheme) -> W4Weight:
    packed, s = _fp4(load, prefix + "weight", prefix + "weight_scale", n, k)
    return W4Weight("fp4", packed, s, None, FP4_GROUP, row_scale=_global(load(prefix + "weight_scale_2"),
                                                                        prefix + "weight_scale_2"))


# the tensor whose presence marks a module as quantized, and the reader
READERS = {
    "gptq": ("qweight", read_gptq),
    "awq": ("qweight", read_awq),
    "compressed-tensors": ("weight_packed", read_ct_int4),
    "nvfp4-ct": ("weight_packed", read_nvfp4_ct),
    "modelopt": ("weight_scale_2", read_modelopt),
}


# ---- quantize on load ------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("group_size",))
def _quantize_int4(w, *, group_size: int):
    """f32[N, K] -> (codes u8[N, K], scales f16[N, G], zeros u8[N, G]): `quantize_int4`."""
    n, k = w.shape
    ng = -(-k // group_size)
    blk = jnp.pad(w, ((0, 0), (0, ng * group_size - k))).reshape(n, ng, group_size)
    lo = jnp.minimum(blk.min(-1), 0.0)
    hi = jnp.maximum(blk.max(-1), 0.0)
    s = exact_div(hi - lo, 15.0).astype(jnp.float16)
    s = jnp.where(s > 0, s, jnp.float16(1.0))
    sf = s.astype(jnp.float32)
    z = jnp.clip(jnp.round(exact_div(-lo, sf)), 0, 15)
    q = jnp.clip(jnp.round(exact_div(blk, sf[..., None])) + z[..., None], 0, 15).astype(jnp.uint8)
    return q.reshape(n, -1)[:, :k], s, z.astype(jnp.uint8)


def quantize_int4(w, group_size: int = INT4_GROUP) -> W4Weight:
    """w f32[N, K] -> asymmetric round-to-nearest int4 per group of `group_size` along K:
    s = (max - min) / 15 (min <= 0 <= max, so 0 is exact), z = round(-min / s), q = clip(round(w / s) + z, 0, 15);
    scales float16 (as GPTQ / AWQ store them)."""
    q, s, z = _quantize_int4(jnp.asarray(w, jnp.float32), group_size=group_size)
    return W4Weight("int4", pack_nibbles(np.asarray(q)), np.asarray(s), np.asarray(z), group_size, k=np.shape(w)[1])


def _round_e2m1(v):
    """f32 values -> the nearest e2m1 code u8 (ties to the even code), saturating at +-6: magnitudes
    0, .5, 1, 1.5, 2 are codes 2a, 2, 3, 4 are 4 + (a - 2), 4 and 6 codes 6 and 7 (round: half to even)."""
    a = jnp.minimum(jnp.abs(v), 6.0)
    code = jnp.where(a <= 2.0, jnp.round(2.0 * a), jnp.where(a <= 4.0, 4.0 + jnp.round(a - 2.0), 6.0 + (a > 5.0)))
    code = code.astype(jnp.uint8)
    return code | ((v < 0) & (code > 0)).astype(jnp.uint8) * 8


@jax.jit
def _quantize_nvfp4(w):
    """f32[N, K] -> (codes u8[N, K], scales e4m3[N, K/16], global scale f32[]): `quantize_nvfp4`."""
    n, k = w.shape
    amax = jnp.max(jnp.abs(w))
    gs = jnp.where(amax > 0, exact_div(amax, 6.0 * 448.0), 1.0).astype(jnp.float32)
    blk = w.reshape(n, k // FP4_GROUP, FP4_GROUP)
    s = exact_div(exact_div(jnp.max(jnp.abs(blk), -1), 6.0), gs).astype(jnp.float8_e4m3fn)
    sf = s.astype(jnp.float32) * gs
    q = _round_e2m1(exact_div(blk, jnp.where(sf > 0, sf, 1.0)[..., None]))
    return q.reshape(n, k), s, gs


def quantize_nvfp4(w) -> W4Weight:
    """w f32[N, K] (K % 16 == 0) -> NVFP4: global = amax / (6 * 448); per 16 elements
    s = e4m3(amax_block / 6 / global); q = e2m1(w / (s * global))."""
    n, k = np.shape(w)
    if k % FP4_GROUP:
        raise TensorShapeError(f"NVFP4 needs K % {FP4_GROUP} == 0; got K={k}")
    q, s, gs = _quantize_nvfp4(jnp.asarray(w, jnp.float32))
    return W4Weight("fp4", pack_nibbles(np.asarray(q)), np.asarray(s), None, FP4_GROUP, row_scale=float(gs), k=k)
