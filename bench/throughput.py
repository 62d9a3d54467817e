"""Throughput / latency benchmark of metrale-jax (the same as `metrale bench`).

    python bench/throughput.py --out bench/results/cpu_smollm2.json --compare-transformers /work/fixvenv/bin/python
    python bench/throughput.py --random-weights --shape llama3-8b --dtype bfloat16 --pallas --startup

See `metrale_jax/engine/bench.py` (or --help) for what is measured.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metrale_jax.engine.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
