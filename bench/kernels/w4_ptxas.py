"""Registers and spills of the one-row 4-bit kernel's launches, compiled for sm_90a on a machine without a GPU.

Registers decide how many of a projection's programs an SM holds at once, and a small change of
where a load or a conversion sits moves them a lot: in session 47, loading a step's scales before
its group sums instead of after gave int4 gate|up 124 registers against 96, and carrying NVFP4's
down scales in the prefetch ring 78 against 56 (2 waves of programs instead of 1). This reads
them without spending GPU time, in two steps:

1. `--dump DIR` (this project's venv, JAX_PLATFORMS=cpu): lowers `skinny_matmul_w4` for an abstract
   H100 at one row for each Llama-3-8B projection, int4 and NVFP4, with the table's params (or
   `--params JSON` for all of them) and writes each Pallas call's Triton module, DIR/NAME.ttir, and
   its launch (num_warps, num_stages), DIR/NAME.json.
2. `--compile DIR` (any Python with the `triton` wheel, e.g. `pip install triton==3.6.0` in a venv
   of its own; no GPU needed): compiles each module for sm_90a (TTIR -> PTX with Triton, then the
   wheel's ptxas) and prints the registers, stack and spills ptxas reports.

The Triton the wheel brings is not the one bundled in jaxlib that compiles these kernels on the
GPU machine, so the counts are a guide, not the launch's own (Nsight Compute reads those); for
session 46's q|k|v pick both said 167 registers.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess


def dump(out: pathlib.Path, params_json: str) -> None:
    import jax
    import jax.numpy as jnp
    from jax._src.pallas.triton import lowering
    from w4 import KINDS
    from w4_chain import LLAMA, projection_shapes

    from pallas_kernels.linear import W4Params, skinny_matmul_w4
    from pallas_kernels.linear.w4 import w4_params_for

    modules = []
    lower = lowering.lower_jaxpr_to_triton_module

    def keep(*args, **kwargs):  # the module each Pallas call lowers to, as text
        result = lower(*args, **kwargs)
        modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    lowering.lower_jaxpr_to_triton_module = keep
    h100 = jax.sharding.AbstractDevice("NVIDIA H100 80GB HBM3", 132, "gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h100)
    sds = jax.ShapeDtypeStruct
    out.mkdir(parents=True, exist_ok=True)
    try:
        for kind, g in KINDS.items():
            for proj, (k, n) in projection_shapes(**LLAMA).items():
                p = W4Params(**json.loads(params_json)) if params_json else w4_params_for(kind, 1, n, k, g)
                scale_dt = jnp.float8_e4m3fn if kind == "fp4" else jnp.float16
                aux = sds((n,), jnp.float32) if kind == "fp4" else sds((n, k // g), jnp.uint8)
                with jax.sharding.use_abstract_mesh(mesh):
                    jax.jit(lambda x, w, s, a, k=k, g=g, kind=kind, p=p: skinny_matmul_w4(
                        x, w, s, a, k=k, group_size=g, kind=kind, params=p)).trace(
                        sds((1, k), jnp.bfloat16), sds((n, k // 2), jnp.uint8), sds((n, k // g), scale_dt), aux
                    ).lower(lowering_platforms=("cuda",))
                (out / f"{kind}_{proj}.ttir").write_text(modules[-1])
                (out / f"{kind}_{proj}.json").write_text(json.dumps(dict(num_warps=p.num_warps,
                                                                          num_stages=p.num_stages)))
                print(f"{kind}_{proj}: {p}")
    finally:
        lowering.lower_jaxpr_to_triton_module = lower


def compile_all(folder: pathlib.Path) -> None:
    import triton
    from triton.backends.compiler import GPUTarget

    ptxas = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    for ttir in sorted(folder.glob("*.ttir")):
        launch = json.loads(ttir.with_suffix(".json").read_text())
        kernel = triton.compile(str(ttir), target=GPUTarget("cuda", 90, 32), options=launch)
        ptx = ttir.with_suffix(".ptx")
        ptx.write_text(kernel.asm["ptx"])
        run = subprocess.run([str(ptxas), "--gpu-name", "sm_90a", "-v", str(ptx), "-o", "/dev/null"],
                             capture_output=True, text=True, check=True)
        info = "; ".join(line.split("info    : ")[-1] for line in run.stderr.splitlines()
                         if "Used" in line or "spill" in line)
        print(f"{ttir.stem:14s} {info}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump", type=pathlib.Path, help="write DIR/*.ttir (this project's venv)")
    ap.add_argument("--params", default="", help="with --dump: W4Params fields as JSON for every projection")
    ap.add_argument("--compile", type=pathlib.Path, help="compile DIR/*.ttir for sm_90a (a venv with triton)")
    a = ap.parse_args(argv)
    if a.dump:
        dump(a.dump, a.params)
    if a.compile:
        compile_all(a.compile)
    if not (a.dump or a.compile):
        ap.error("--dump DIR or --compile DIR")


if __name__ == "__main__":
    main()
