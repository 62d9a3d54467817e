"""Inline PTX with several results, for Pallas kernels lowered through Triton.

`jax.experimental.pallas.triton.elementwise_inline_asm` (jax 0.11.2) wraps the op's results in a
one-element list, so an asm with more than one output fails to lower ("8 outvars do not match 1
outvals"). This primitive is the same Triton op (`tt.elementwise_inline_asm`) with every result
returned. It uses jax's private Pallas Triton lowering table (jax is pinned to 0.11.2); it has no CPU
rule: kernels run a jnp twin of the asm in interpret mode.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax._src import core as jax_core
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering
from jax.interpreters import mlir

inline_asm_p = jax_core.Primitive("metrale_inline_asm")
inline_asm_p.multiple_results = True


@inline_asm_p.def_abstract_eval
def _abstract_eval(*avals, result_shape_dtypes, **_):
    if any(a.shape != avals[0].shape for a in avals):
        raise ValueError("inline_asm: every argument must have the same shape")
    return [jax_core.ShapedArray(s.shape, s.dtype) for s in result_shape_dtypes]


@lowering.register_lowering(inline_asm_p)
def _lowering(ctx, *args, asm, constraints, pack, result_shape_dtypes):
    del result_shape_dtypes
    op = tt_dialect.ElementwiseInlineAsmOp(
        [mlir.aval_to_ir_type(ctx.context.mlir_ctx, aval) for aval in ctx.avals_out], asm, constraints, True, pack,
        list(args))
    return list(op.results)


def inline_asm(asm: str, *, args: Sequence[jax.Array], constraints: str, pack: int,
               result_shape_dtypes: Sequence[jax.ShapeDtypeStruct]) -> list[jax.Array]:
    """`elementwise_inline_asm` returning all of `result_shape_dtypes` (same arguments)."""
    return inline_asm_p.bind(*args, asm=asm, constraints=constraints, pack=pack,
                             result_shape_dtypes=tuple(result_shape_dtypes))
