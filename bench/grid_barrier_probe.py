"""What does a grid-wide barrier inside one Pallas Triton kernel cost, against a kernel boundary?

A one-row decode layer is ~15 launches on the GPU (the 4-bit projections, norms, RoPE and the K/V
write, attention and its combine, adds), each kernel boundary ~0.9-2 us of a 2.6 ms step (session
50-51's probe: B starts 0.93 us after A ends through XLA). A persistent kernel would replace the
boundaries between a layer's pieces with grid barriers (every program arrives at an atomic counter,
then waits for all of them) and could load the next piece's weights before it waits. This times
both forms of the same chain of `--phases` dependent steps on `--programs` programs of one warp
(each step reads the row another program wrote in the step before, adds one, writes its own):
  * `launches`: one kernel a step, in one executable (XLA's kernel boundaries);
  * `barriers`: one kernel, the steps separated by a grid barrier (a CTA barrier, an atomic add on
    a counter, acquire-release at GPU scope, then spinning on atomic reads until all have arrived;
    reads after it are volatile). Every program must be resident at once: one program a streaming
    multiprocessor at most (the default, the device's SM count) is.
Both are checked against numpy. Printed: microseconds a step, each form (median of 7 groups).
The barrier form deadlocks in Pallas interpret mode (programs run one after another), so on the
CPU the script only cross-lowers both forms for an H200 (`--lower-only`).

    PYTHONPATH=. python3 bench/grid_barrier_probe.py --out DIR [--phases 16] [--programs N]
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

sys.path.insert(0, str(pathlib.Path(__file__).parent / "kernels"))
from timing import median_seconds  # noqa: E402

WIDTH = 128  # f32 values a program moves a step


def _step_kernel(x_ref, o_ref, *, programs: int):
    """o[p] = x[(p + 1) % P] + 1 (one step, one launch)."""
    p = pl.program_id(0)
    cols = jnp.arange(WIDTH, dtype=jnp.int32)
    src = (p + 1) % programs
    o_ref[p, :] = plt.load(x_ref.at[src + 0 * cols, cols]) + 1.0


def _grid_barrier(count_ref, target):
    """Wait until `target` programs have arrived at count_ref[0] (this one included)."""
    plt.debug_barrier()  # (this program's stores issued before it arrives)
    arrived = plt.atomic_add(count_ref, 0, jnp.int32(1)) + 1  # (acquire-release, GPU scope)
    jax.lax.while_loop(lambda c: c < target, lambda c: plt.atomic_add(count_ref, 0, jnp.int32(0)), arrived)
    plt.debug_barrier()


def _persistent_kernel(x_ref, _count_in, buf0_ref, buf1_ref, count_ref, *, programs: int, phases: int):
    """The same `phases` steps in one launch, through two buffers, a grid barrier between steps."""
    p = pl.program_id(0)
    cols = jnp.arange(WIDTH, dtype=jnp.int32)
    src = (p + 1) % programs
    bufs = (buf0_ref, buf1_ref)
    for k in range(phases):
        if k == 0:
            v = plt.load(x_ref.at[src + 0 * cols, cols])
        else:
            v = plt.load(bufs[(k - 1) % 2].at[src + 0 * cols, cols], volatile=True)
        plt.store(bufs[k % 2].at[p + 0 * cols, cols], v + 1.0)
        if k + 1 < phases:
            _grid_barrier(count_ref, programs * (k + 1))


def launches(x, *, programs: int, phases: int, interpret: bool = False):
    step = pl.pallas_call(functools.partial(_step_kernel, programs=programs), grid=(programs,),
                          in_specs=[pl.no_block_spec], out_specs=pl.no_block_spec,
                          out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          compiler_params=plt.CompilerParams(num_warps=1), interpret=interpret,
                          name="grid_probe_step")
    for _ in range(phases):
        x = step(x)
    return x


def barriers(x, *, programs: int, phases: int):
    count = jnp.zeros((1,), jnp.int32)  # (a fresh zero a call: the counter is the call's own)
    sds = jax.ShapeDtypeStruct
    buf0, buf1, _ = pl.pallas_call(
        functools.partial(_persistent_kernel, programs=programs, phases=phases), grid=(programs,),
        in_specs=[pl.no_block_spec] * 2, out_specs=[pl.no_block_spec] * 3,
        out_shape=[sds(x.shape, x.dtype), sds(x.shape, x.dtype), sds((1,), jnp.int32)],
        input_output_aliases={1: 2}, compiler_params=plt.CompilerParams(num_warps=1),
        name="grid_probe_persistent")(x, count)
    return buf1 if phases % 2 == 0 else buf0


def expected(x: np.ndarray, phases: int) -> np.ndarray:
    return np.roll(x, -phases, axis=0) + phases


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--phases", type=int, default=16)
    ap.add_argument("--programs", type=int, default=None, help="default: the device's SM count (one each)")
    ap.add_argument("--lower-only", action="store_true", help="on the CPU: cross-lower both forms for an H200, and "
                    "run the launches form in interpret mode against numpy")
    a = ap.parse_args(argv)
    if a.lower_only:
        x = np.random.default_rng(0).integers(-1000, 1000, (8, WIDTH)).astype(np.float32)  # (exact sums)
        got = launches(jnp.asarray(x), programs=8, phases=3, interpret=True)
        print("launches in interpret mode match numpy:", bool(np.array_equal(np.asarray(got), expected(x, 3))))
        h200 = jax.sharding.AbstractDevice("NVIDIA H200", 132, "gpu")
        mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h200)
        x = jax.ShapeDtypeStruct((a.programs or 132, WIDTH), jnp.float32)
        with jax.sharding.use_abstract_mesh(mesh):
            for form in (launches, barriers):
                f = jax.jit(functools.partial(form, programs=x.shape[0], phases=a.phases))
                text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
                print(form.__name__, "lowers:", text.count("__gpu$xla.gpu.triton"), "Triton kernels")
        return
    dev = jax.devices()[0]
    programs = a.programs or int(getattr(dev, "core_count", 132))
    x = jnp.asarray(np.random.default_rng(0).integers(-1000, 1000, (programs, WIDTH)), jnp.float32)  # (exact sums)
    want = expected(np.asarray(x), a.phases)
    rows = []
    empty = median_seconds(jax.jit(lambda v: v + 0.0), x, group=20)  # (one small launch: the floor)
    for form in (launches, barriers):
        f = jax.jit(functools.partial(form, programs=programs, phases=a.phases))
        got = np.asarray(f(x))
        ok = bool(np.array_equal(got, want))
        t = median_seconds(f, x, group=20)
        rows.append(dict(form=form.__name__, programs=programs, phases=a.phases, correct=ok,
                         us_per_call=t * 1e6, us_per_step=(t - empty) * 1e6 / a.phases, us_empty_call=empty * 1e6))
        print(json.dumps(rows[-1]), flush=True)
    if a.out:
        out = pathlib.Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "grid_barrier_probe.json").write_text(json.dumps(dict(
            device=getattr(dev, "device_kind", str(dev)), jax=jax.__version__, rows=rows), indent=1))


if __name__ == "__main__":
    main()
