"""Which parts of each step executable XLA captures as command buffers (CUDA graphs), and what it
launches one by one from the host: the default engine's executables, then the mixed / prefill
buckets again with the Triton prefill attention instead of the Mosaic GPU one.

    python bench/command_buffers.py [--shape llama3-8b] [--num-layers N] [--out DIR]

A step the host launches kernel by kernel costs host time per kernel (a verify or mixed step is
read back at once, so the device waits for it). Prints, per executable, the ENTRY computation's
instructions by opcode (command-buffer calls counted apart) and the custom calls outside them.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def summarize(hlo: str) -> dict:
    """Counts of the ENTRY computation's instructions: command-buffer calls, and the rest by opcode
    (custom calls by target)."""
    entry = hlo[hlo.index("\nENTRY "):]
    entry = entry[: entry.index("\n}") if "\n}" in entry else len(entry)]
    ops: collections.Counter = collections.Counter()
    for line in entry.splitlines()[1:]:
        m = re.search(r"=\s*[^=]*?\s([a-z][a-z0-9-]*)\(", line)
        if not m:
            continue
        op = m.group(1)
        if op == "call" and "command_buffer" in line:
            op = "command_buffer"
        elif op == "custom-call":
            t = re.search(r'custom_call_target="([^"]+)"', line)
            op = f"custom-call:{t.group(1) if t else '?'}"
        ops[op] += 1
    return dict(ops.most_common())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args()

    from metrale_jax import LLMEngine, random_model
    from metrale_jax.engine.bench import shape_config
    from metrale_jax.engine.compile import CompilationManager
    from metrale_jax.engine.config import EngineConfig

    model, params = random_model(shape_config(a.shape, a.num_layers), dtype="bfloat16", repeat_layers=True,
                                 split_layers=True)
    eng = LLMEngine(model, params, EngineConfig(dtype="bfloat16", max_model_len=2048, show_progress=False))
    res = {"shape": a.shape, "num_layers": a.num_layers, "executables": {}}
    exes = {str(b): e for b, e in eng.compiler.executables.items()}
    exes.update({f"{h} {b}": e for (h, b), e in eng.compiler.split_executables.items()})
    for name, exe in exes.items():
        res["executables"][name] = summarize(exe.as_text())
        print(name, json.dumps(res["executables"][name]), flush=True)
    attn = dataclasses.replace(eng.config.attention, mosaic_prefill=False)
    cm = CompilationManager(model, eng.config.replace(attention=attn), eng.builder)
    for b in [b for b in cm.buckets if b.kind in ("mixed", "prefill")][:2]:
        s = summarize(cm.lower(b, eng.params, eng.state).compile().as_text())
        res["executables"][f"{b} triton prefill attention"] = s
        print(b, "triton prefill attention", json.dumps(s), flush=True)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "command_buffers.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
