"""Loading speed (issue 14): a `bench/random_checkpoint.py` safetensors checkpoint, already in the
page cache, streamed to the device by `load_model` (per-layer arrays on the GPU, as `LLM(...)`
loads them), in GB/s of parameters placed on the device. The first load warms the page cache;
the second is the figure (bar: >= 2 GB/s).

    python bench/load_speed.py --shape llama3-8b --num-layers 8 --dir /tmp/ckpt_llama8l
    python bench/load_speed.py --gptq --dir /tmp/ckpt_llama8l_gptq     # the layers' linears 4-bit GPTQ

(4-bit: GB/s of the packed parameters placed, less than the checkpoint's bytes read.)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--out", default=None)
    p.add_argument("--gptq", action="store_true", help="the layers' linears 4-bit (random_checkpoint.py --gptq)")
    a = p.parse_args()
    if not (a.dir / "model.safetensors").exists():
        t = time.perf_counter()
        subprocess.run([sys.executable, str(ROOT / "bench" / "random_checkpoint.py"), "--shape", a.shape,
                        "--num-layers", str(a.num_layers), "--out", str(a.dir)] + ["--gptq"] * a.gptq, check=True)
        print(f"wrote the checkpoint in {time.perf_counter() - t:.1f}s", flush=True)
    import jax

    from metrale_jax.model import load_model

    on_gpu = jax.devices()[0].platform == "gpu"
    runs = []
    for _ in range(2):
        t = time.perf_counter()
        _, params = load_model(a.dir, dtype="bfloat16", show_progress=False, split_layers=on_gpu)
        jax.block_until_ready(params)
        dt = time.perf_counter() - t
        nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
        runs.append(dict(seconds=dt, gbytes=nbytes / 1e9, gb_per_s=nbytes / 1e9 / dt))
        del params
        print(f"load_model: {nbytes / 1e9:.2f} GB in {dt:.2f}s = {nbytes / 1e9 / dt:.2f} GB/s", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(dict(shape=a.shape, num_layers=a.num_layers, gptq=a.gptq, runs=runs,
                                               device=str(jax.devices()[0]), jax=jax.__version__), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
