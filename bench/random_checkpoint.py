"""Write a Hugging Face checkpoint with random weights of a known shape, for the GPU machine.

    python bench/random_checkpoint.py --shape smollm2-135m --dtype bfloat16 --out /tmp/rand \\
        [--tokenizer-dir DIR]

The family's own weight map decides every tensor name and shape (it is run against a reader
that records what it asks for), so the checkpoint loads through the normal `load_model` path.
`--tokenizer-dir` copies tokenizer.json / tokenizer_config.json next to it (for text serving).
`--gptq` writes the decoder linears (`*_proj.weight` of the layers) as 4-bit GPTQ tensors instead
(random codes, group 128, a config.json `quantization_config` saying so), for the 4-bit loading
speed (`bench/load_speed.py --gptq`).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from metrale_jax.config import ModelConfig
from metrale_jax.engine.bench import SHAPES, shape_config
from metrale_jax.loading.random_weights import RandomWeightReader
from metrale_jax.models import family_for


class _Recorder(RandomWeightReader):
    """Hands out random tensors and keeps each one under its checkpoint name."""

    def __init__(self, dtype, seed):
        super().__init__(dtype, seed=seed)
        self.tensors: dict[str, np.ndarray] = {}

    def get(self, name, shape, cast=False):
        arr = super().get(name, shape, cast=False)
        self.tensors[name] = arr.astype(self.dtype)
        return self.cast(arr) if cast else arr

    def to_device(self, tree):
        return tree  # nothing goes to a device here


def _gptq(tensors: dict, config: dict, rng) -> None:
    """The layers' `*_proj.weight` [N, K] in `tensors` replaced by random GPTQ tensors (v1, group 128)."""
    for name in [n for n, w in tensors.items() if ".layers." in n and n.endswith("_proj.weight") and w.ndim == 2]:
        n, k = tensors.pop(name).shape
        p = name[: -len("weight")]
        tensors[p + "qweight"] = rng.integers(0, 2**32, (k // 8, n), dtype=np.uint32).view(np.int32)
        tensors[p + "qzeros"] = np.full((k // 128, n // 8), 0x77777777, np.uint32).view(np.int32)
        tensors[p + "scales"] = (rng.random((k // 128, n), np.float32) * 0.01).astype(np.float16)
        tensors[p + "g_idx"] = (np.arange(k) // 128).astype(np.int32)
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
                                     "sym": True, "checkpoint_format": "gptq"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-layers", type=int, default=None, help="cut the depth (engine.bench.shape_config)")
    p.add_argument("--tokenizer-dir", type=Path)
    p.add_argument("--gptq", action="store_true", help="the layers' linears as 4-bit GPTQ (random codes)")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    config = {**shape_config(a.shape, a.num_layers), "torch_dtype": a.dtype}
    cfg = ModelConfig.from_hf(config)
    _, fam = family_for(cfg.architecture)
    rec = _Recorder(a.dtype, a.seed)
    fam.load_params(fam.adapt_config(cfg), rec)
    if a.gptq:
        _gptq(rec.tensors, config, np.random.default_rng(a.seed))
    a.out.mkdir(parents=True, exist_ok=True)
    save_file(rec.tensors, str(a.out / "model.safetensors"))
    (a.out / "config.json").write_text(json.dumps(config, indent=1))
    if a.tokenizer_dir:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            if (a.tokenizer_dir / f).exists():
                shutil.copy(a.tokenizer_dir / f, a.out / f)
    print(f"wrote {len(rec.tensors)} tensors to {a.out}")


if __name__ == "__main__":
    main()
