"""Does XLA launch a Pallas Triton kernel with programmatic dependent launch (PDL)?

Two Pallas Triton kernels in a chain, A -> B -> A -> B ... (each reads the one before's
output). A calls `griddepcontrol.launch_dependents` (or not), then spins for `--spin-us`
reading `%globaltimer`, then writes its end time. B reads `%globaltimer` as it starts, then
`griddepcontrol.wait`, then reads A's output. If B's programs start before A's last program
ends, the launch had the PDL attribute (the instructions are no-ops in a normal launch).
Printed per variant: B's earliest start minus A's latest end, in microseconds, over the chain
(negative: overlap, so PDL is on), beside the XLA options it was compiled with; then the same two
kernels through Triton's own launcher with and without `launch_pdl` (the control: torch, triton).
H100, jax 0.11.2, session 51 (B's wait kept; session 50's runs had it folded away): +0.93 us
through XLA with its default options or its PDL options on, with or without A's trigger, +1.9-2.0
with the options off: no early start. Triton's launcher with `launch_pdl` overlapped in session 50
(-2.9 us) and not in session 51 (+7.2): the control is not dependable.

    python bench/pdl_triton_probe.py --out DIR
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

# the low 32 bits of %globaltimer (ns; differences taken mod 2^32); the input is only a dependency
_TIMER = "{\n\t.reg .u64 t;\n\tmov.u64 t, %globaltimer;\n\tcvt.u32.u64 $0, t;\n\t}"


def _asm(asm, dep, dtype, constraint):
    [out] = plt.elementwise_inline_asm(asm, args=[dep], constraints=constraint, pack=1,
                                       result_shape_dtypes=[jax.ShapeDtypeStruct(dep.shape, dtype)])
    return out


def _timer(dep):  # i32 nanoseconds (wrapping), read after dep is available
    return _asm(_TIMER, dep.astype(jnp.int32), jnp.int32, "=r,r")


def _kernel_a(x_ref, o_ref, *, spin_ns: int, trigger: bool):
    v = x_ref[pl.ds(0, 1)]  # i32[1] (the inline asm works on vectors)
    if trigger:
        v = _asm("griddepcontrol.launch_dependents;\n\tmov.b32 $0, $1;", v, jnp.int32, "=r,r")
    t0 = _timer(v)
    t1 = jax.lax.while_loop(lambda t: jnp.max(t - t0) < spin_ns, _timer, t0)
    o_ref[pl.ds(pl.program_id(0), 1)] = t1  # this program's end


def _kernel_b(a_ref, o_ref, s_ref):
    pid = pl.program_id(0)
    dummy = jnp.zeros((1,), jnp.int32) + pid
    start = _timer(dummy)
    # (the wait takes the start time as its input: a pure inline asm may be reordered otherwise)
    w = _asm("griddepcontrol.wait;\n\tmov.b32 $0, 0;", start, jnp.int32, "=r,r")
    s_ref[pl.ds(pid, 1)] = start
    # (w is 0, but opaque to the compiler: `w * 0` would fold, and the unused pure asm, the wait
    # with it, would be dropped; session 50's three runs had that form)
    o_ref[pl.ds(pid, 1)] = a_ref[pl.ds(pid, 1)] + w


def _chain(x, *, programs, links, spin_ns, trigger):
    a_call = pl.pallas_call(
        functools.partial(_kernel_a, spin_ns=spin_ns, trigger=trigger),
        out_shape=jax.ShapeDtypeStruct((programs,), jnp.int32), grid=(programs,),
        compiler_params=plt.CompilerParams(num_warps=1))
    b_call = pl.pallas_call(
        _kernel_b,
        out_shape=(jax.ShapeDtypeStruct((programs,), jnp.int32), jax.ShapeDtypeStruct((programs,), jnp.int32)),
        grid=(programs,),
        compiler_params=plt.CompilerParams(num_warps=1))
    ends, starts = [], []
    v = x
    for _ in range(links):
        a_end = a_call(v)
        b_out, b_start = b_call(a_end)
        ends.append(a_end)
        starts.append(b_start)
        v = b_out[:1] * 0 + x
    return jnp.stack(ends), jnp.stack(starts)


def probe(programs: int, links: int, spin_us: float, trigger: bool, options: dict | None) -> dict:
    x = jnp.zeros((1,), jnp.int32)
    f = jax.jit(functools.partial(_chain, programs=programs, links=links, spin_ns=int(spin_us * 1e3),
                                  trigger=trigger))
    exe = f.lower(x).compile(compiler_options=options)
    exe(x)
    gaps = []
    for _ in range(5):
        ends, starts = (np.asarray(a) for a in exe(x))
        # B's earliest start minus A's latest end, mod 2^32 ns, per link
        d = (starts.astype(np.int64)[:, :, None] - ends.astype(np.int64)[:, None, :]) % (1 << 32)
        d = np.where(d >= 1 << 31, d - (1 << 32), d)
        gaps.append(d.min(axis=(1, 2)) / 1e3)
    gaps = np.asarray(gaps)
    return dict(programs=programs, links=links, spin_us=spin_us, trigger=trigger, options=options,
                gap_us_median=float(np.median(gaps)), gap_us_min=float(gaps.min()), gap_us_max=float(gaps.max()))


def triton_control(programs: int, spin_us: float) -> dict:
    """The same two kernels through Triton's own launcher with `launch_pdl` (torch tensors): the
    probe's positive control, where the secondary is known to be launched with PDL."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def timer(dep):  # (_TIMER written out: a Triton kernel reads no plain globals)
        return tl.inline_asm_elementwise("{\n\t.reg .u64 t;\n\tmov.u64 t, %globaltimer;\n\tcvt.u32.u64 $0, t;\n\t}",
                                         "=r,r", [dep], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def a_kernel(x_ptr, o_ptr, spin_ns):
        v = tl.load(x_ptr + tl.arange(0, 1))
        v = tl.inline_asm_elementwise("griddepcontrol.launch_dependents;\n\tmov.b32 $0, $1;", "=r,r", [v],
                                      dtype=tl.int32, is_pure=False, pack=1)
        t0 = timer(v)
        t = t0
        while tl.max(t - t0) < spin_ns:
            t = timer(t)
        tl.store(o_ptr + tl.program_id(0) + tl.arange(0, 1), t)

    @triton.jit
    def b_kernel(a_ptr, o_ptr, s_ptr):
        pid = tl.program_id(0)
        start = timer(tl.zeros((1,), tl.int32) + pid)
        w = tl.inline_asm_elementwise("griddepcontrol.wait;\n\tmov.b32 $0, 0;", "=r,r", [start],
                                      dtype=tl.int32, is_pure=False, pack=1)
        tl.store(s_ptr + pid + tl.arange(0, 1), start)
        tl.store(o_ptr + pid + tl.arange(0, 1), tl.load(a_ptr + pid + w + tl.arange(0, 1)))

    x = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = {}
    for pdl in (False, True):
        gaps = []
        for _ in range(5):
            a = torch.empty(programs, dtype=torch.int32, device="cuda")
            b = torch.empty_like(a)
            s = torch.empty_like(a)
            a_kernel[(programs,)](x, a, int(spin_us * 1e3), num_warps=1)
            b_kernel[(programs,)](a, b, s, num_warps=1, launch_pdl=pdl)
            torch.cuda.synchronize()
            d = (s.cpu().numpy().astype(np.int64)[:, None] - a.cpu().numpy().astype(np.int64)[None, :]) % (1 << 32)
            d = np.where(d >= 1 << 31, d - (1 << 32), d)
            gaps.append(d.min() / 1e3)
        out[f"launch_pdl={pdl}"] = float(np.median(gaps))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--programs", type=int, default=128, help="a power of two")
    ap.add_argument("--links", type=int, default=8, help="A -> B pairs in the longer chain")
    ap.add_argument("--spin-us", type=float, default=20.0)
    a = ap.parse_args(argv)
    on = {"xla_gpu_enable_pdl": True, "xla_gpu_enable_pdl_launch": True}
    off = {"xla_gpu_enable_pdl": False, "xla_gpu_enable_pdl_launch": False}
    rows = []
    for trigger in (True, False):
        for options in (None, on, off):
            for links in (1, a.links):
                try:
                    row = probe(a.programs, links, a.spin_us, trigger, options)
                except Exception as e:  # noqa: BLE001 - recorded
                    row = dict(trigger=trigger, options=options, links=links, error=f"{type(e).__name__}: {e}"[:400])
                rows.append(row)
                print(json.dumps(row), flush=True)
    try:
        control = triton_control(a.programs, a.spin_us)
    except Exception as e:  # noqa: BLE001 - recorded
        control = f"{type(e).__name__}: {e}"[:400]
    print("triton's launcher (gap_us median):", json.dumps(control), flush=True)
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = jax.devices()[0]
    (out / "pdl_triton_probe.json").write_text(json.dumps(dict(
        device=getattr(dev, "device_kind", str(dev)), jax=jax.__version__, rows=rows, triton_control=control),
        indent=1))


if __name__ == "__main__":
    main()
