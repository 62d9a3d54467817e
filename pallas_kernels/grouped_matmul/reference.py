"""Float32 naive reference of the grouped GEMM (the semantics of `jax.lax.ragged_dot`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def row_groups(group_sizes, m: int):
    """The group of each row: i32[m], and num_groups for rows past sum(group_sizes).

    group_sizes i32[E] (negative sizes count as 0; rows past m are cut off).
    """
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), m)  # i32[E]
    return jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right").astype(jnp.int32)


@jax.jit
def grouped_matmul_reference(x, w, group_sizes):
    """x [M, K], w [E, K, N], group_sizes i32[E] -> f32[M, N].

    Row r of x belongs to group g when sum(group_sizes[:g]) <= r < sum(group_sizes[:g+1]); its
    output row is x[r] @ w[g] in float32. Rows past sum(group_sizes) are zero. One dense matmul
    per group, masked: O(E*M*K*N), for tests only.
    """
    m = x.shape[0]
    g = row_groups(group_sizes, m)  # i32[M]
    xf = x.astype(jnp.float32)
    wf = w.astype(jnp.float32)

    def one(acc, e):
        y = jnp.dot(xf, wf[e], precision=jax.lax.Precision.HIGHEST)  # f32[M, N]
        return acc + jnp.where((g == e)[:, None], y, 0.0), None

    acc0 = jnp.zeros((m, w.shape[2]), jnp.float32)
    return jax.lax.scan(one, acc0, jnp.arange(w.shape[0]))[0]
