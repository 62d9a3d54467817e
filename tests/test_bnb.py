"""bitsandbytes checkpoints (NF4 / FP4 with and without double quantization, LLM.int8), dequantized at
load to run dense.

Oracle: tensors written here as bitsandbytes' `Params4bit` / `Int8Params` serialize them (layouts
from its `functional.py` and default ops), the reference weight computed from the codes and
scales chosen here, never by unpacking the bytes (nothing shared with metrale_jax/quant/bnb.py);
models against dense checkpoints holding the same values.
"""

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from metrale_jax import load_model
from metrale_jax.errors import CorruptCheckpointError, TensorShapeError, UnsupportedDtypeError
from metrale_jax.quant import bnb
from tests.conftest import FIXTURES, DictLoad

NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]
FP4 = [v / 12.0 for v in (0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, -0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0)]


def _pack4(w: np.ndarray, kind: str, block: int, double: bool) -> tuple[dict, np.ndarray]:
    """w f32[N, K] -> (the module's tensors by suffix, the dequantized f32[N, K])."""
    n, k = w.shape
    table = np.asarray(NF4 if kind == "nf4" else FP4, np.float32)
    flat = w.reshape(-1)
    size = flat.size
    nb = -(-size // block)
    absmax = np.array([np.abs(flat[b * block:(b + 1) * block]).max() for b in range(nb)], np.float32)
    qs = {"quant_type": kind, "blocksize": block, "dtype": "float32", "shape": [n, k]}
    t = {"weight.quant_map": table}
    scales = absmax
    if double:  # the scales as 8-bit codes of a 256-entry table, per 256 scales, around their mean
        nested = np.linspace(-1, 1, 256).astype(np.float32)
        offset = float(absmax.mean())
        nbs = 256
        centred = absmax - np.float32(offset)
        nmax = np.array([np.abs(centred[b * nbs:(b + 1) * nbs]).max() for b in range(-(-nb // nbs))], np.float32)
        idx = np.array([np.abs(nested - centred[i] / nmax[i // nbs]).argmin() for i in range(nb)], np.uint8)
        scales = np.array([nested[idx[i]] * nmax[i // nbs] for i in range(nb)], np.float32) + np.float32(offset)
        t.update({"weight.absmax": idx, "weight.nested_absmax": nmax, "weight.nested_quant_map": nested})
        qs.update(nested_blocksize=nbs, nested_offset=offset, nested_dtype="float32")
    else:
        t["weight.absmax"] = absmax
    codes = np.array([np.abs(table - flat[i] / scales[i // block]).argmin() for i in range(size)], np.uint8)
    deq = np.array([table[codes[i]] * scales[i // block] for i in range(size)], np.float32).reshape(n, k)
    padded = np.concatenate([codes, np.zeros(size % 2, np.uint8)])
    t["weight"] = (padded[0::2] << 4 | padded[1::2]).astype(np.uint8)[:, None]  # element 2i: the high nibble
    t[f"weight.quant_state.bitsandbytes__{kind}"] = np.frombuffer(json.dumps(qs).encode(), np.uint8).copy()
    return t, deq


def _pack8(w: np.ndarray) -> tuple[dict, np.ndarray]:
    scb = np.abs(w).max(axis=1).astype(np.float32)
    q = np.clip(np.round(w * 127 / scb[:, None]), -127, 127).astype(np.int8)
    return {"weight": q, "SCB": scb}, q.astype(np.float32) * scb[:, None] / 127


@pytest.mark.parametrize("kind,double", [("nf4", True), ("nf4", False), ("fp4", False), ("int8", False)])
@pytest.mark.parametrize("n,k,block", [(9, 13, 64), (8, 96, 32), (40, 500, 64), (301, 1001, 32)])
def test_readers(kind, double, n, k, block):
    """An odd element count (9 x 13: a padded last byte, a partial last block), whole blocks, 313
    scales (40 x 500 in blocks of 64: two nested blocks of 256 scales, the last partial), and
    301 x 1001 in blocks of 32: three of the reader's bands of 4,096 blocks, the last partial."""
    w = np.random.default_rng(n * k).standard_normal((n, k)).astype(np.float32)
    if kind == "int8":
        t, deq = _pack8(w)
        scheme, read = bnb.BnbScheme("bnb8"), bnb.read_bnb8
    else:
        t, deq = _pack4(w, kind, block, double)
        scheme, read = bnb.BnbScheme("bnb4"), bnb.read_bnb4
    got = read(DictLoad({"m." + x: v for x, v in t.items()}), "m.", n, k, scheme)
    np.testing.assert_allclose(got, deq, rtol=1e-6, atol=1e-7)
    assert np.abs(got - w).max() < 0.3 * np.abs(w).max()  # and it is w, quantized


def test_reader_errors():
    w = np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32)
    t, _ = _pack4(w, "nf4", 64, True)
    with pytest.raises(TensorShapeError, match="shape"):
        bnb.read_bnb4(DictLoad({"m." + x: v for x, v in t.items()}), "m.", 4, 16, bnb.BnbScheme("bnb4"))
    bad = {"m." + x: v for x, v in t.items()}
    bad["m.weight.quant_state.bitsandbytes__fp4"] = bad["m.weight.quant_state.bitsandbytes__nf4"]
    with pytest.raises(CorruptCheckpointError, match="quant_state"):
        bnb.read_bnb4(DictLoad(bad), "m.", 4, 32, bnb.BnbScheme("bnb4"))
    with pytest.raises(UnsupportedDtypeError, match="exactly one"):
        bnb.parse_bnb_config({"quant_method": "bitsandbytes"})
    assert bnb.parse_bnb_config({"quant_method": "gptq", "bits": 4}) is None


@pytest.mark.parametrize("kind", ["nf4_double", "fp4", "nf4_bf16_storage", "int8"])
def test_bnb_checkpoints_load_dense(tmp_path, caplog, kind):
    """A bitsandbytes checkpoint (every linear but lm_head, as transformers quantizes them) gives the
    logits of the dense checkpoint holding its dequantized weights, with one warning; the packed
    codes may be stored viewed as another dtype (`bnb_4bit_quant_storage`)."""
    import jax.numpy as jnp

    t = load_file(FIXTURES / "llama_tiny" / "model.safetensors")
    dense, quant = dict(t), dict(t)
    for nm, w in t.items():
        if nm.endswith("_proj.weight"):
            w = w.astype(np.float32)
            tensors, dense[nm] = _pack8(w) if kind == "int8" else _pack4(w, kind[:3], 64, kind.endswith("double"))
            if kind.endswith("bf16_storage"):
                tensors["weight"] = tensors["weight"].reshape(-1).view(ml_dtypes.bfloat16)[:, None]
            del quant[nm]
            quant.update({nm[: -len("weight")] + x: v for x, v in tensors.items()})
    qc = ({"quant_method": "bitsandbytes", "load_in_8bit": True, "llm_int8_threshold": 6.0} if kind == "int8" else
          {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": kind[:3],
           "bnb_4bit_use_double_quant": kind.endswith("double"), "bnb_4bit_compute_dtype": "float32",
           "bnb_4bit_quant_storage": "bfloat16" if kind.endswith("bf16_storage") else "uint8"})
    cfg = json.loads((FIXTURES / "llama_tiny" / "config.json").read_text())
    for sub, tensors, c in (("dense", dense, cfg), ("q", quant, dict(cfg, quantization_config=qc))):
        (tmp_path / sub).mkdir()
        save_file(tensors, tmp_path / sub / "model.safetensors")
        (tmp_path / sub / "config.json").write_text(json.dumps(c))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 11)))
    model, ref = load_model(tmp_path / "dense", dtype="float32", show_progress=False)
    with caplog.at_level("WARNING"):
        _, params = load_model(tmp_path / "q", dtype="float32", show_progress=False)
    np.testing.assert_allclose(np.asarray(model.forward(params, ids)), np.asarray(model.forward(ref, ids)),
                               atol=2e-4, rtol=2e-4)
    assert "no kernel here runs bitsandbytes weights" in caplog.text and "mlp.down_proj" in caplog.text
