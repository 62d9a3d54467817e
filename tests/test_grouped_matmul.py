"""bench/kernels/grouped_matmul.py (the MoE grouped GEMM benchmark of issue 6) in `--smoke` mode on
the CPU: XLA ragged_dot on tiny shapes, checked against its own f32-output run. There is no grouped
GEMM kernel of ours any more (tokamax won on the H200, see bench/results/grouped_matmul_2026-11-29.md);
this only keeps the benchmark script from rotting.
"""

import importlib.util
import json
import pathlib


def test_bench_script_smoke(tmp_path):
    path = pathlib.Path(__file__).parents[1] / "bench" / "kernels" / "grouped_matmul.py"
    spec = importlib.util.spec_from_file_location("bench_grouped_matmul", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--smoke", "--out", str(tmp_path)])
    (res,) = [json.loads(p.read_text()) for p in tmp_path.glob("grouped_matmul_*_smoke.json")]
    assert not res["errors"]
    ok = {(r["case"], r["impl"]): r for r in res["rows"] if "error" not in r}
    for case in ("smoke_prefill", "smoke_decode"):
        assert ok[(case, "xla ragged_dot")]["max_rel_err"] < 2e-2
        assert ok[(case, "xla ragged_dot(f32 out)")]["max_rel_err"] == 0.0
    md = next(tmp_path.glob("grouped_matmul_*_smoke.md")).read_text()
    assert "| smoke_decode | xla ragged_dot |" in md
