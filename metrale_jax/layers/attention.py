"""The attention interface: dense (no paging) and paged (decode rows / ragged prefill).

Paged attention reads the K/V pools only; the step writes the new tokens' K/V first with
`cache.kv.write_kv`. `AttentionConfig` is the static choice of implementation: the pure-XLA
reference below (the CPU default) or the Pallas kernels of `pallas_kernels/paged_attention`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from metrale_jax.cache.kv import KVCache, gather_kv
from metrale_jax.metadata import AttnMetadata, BatchedAttnMetadata

NEG_INF = -1e30


@dataclass(frozen=True)
class AttentionConfig:
    """Static kernel choices of a step. use_pallas=False is the XLA reference (CPU default);
    True runs the Pallas kernels (attention, and the conv1d / GDN / SSD scans of hybrids)."""

    use_pallas: bool = False
    interpret: bool = False  # run the Pallas kernels in interpret mode (CPU tests)
    sliding_window: int | None = None
    # Walk the layers of the paged steps in a Python loop over per-layer arrays instead of
    # `lax.scan`, whose per-layer weight slices XLA copies on the GPU (layers/stack.py; the
    # engine's GPU default).
    unroll_layers: bool = False
    # MoE experts through tokamax's grouped GEMM (`tokamax.ragged_dot`, Mosaic GPU) instead of
    # `jax.lax.ragged_dot`: 3-20x faster on the H200 (bench/results/grouped_matmul_2026-11-29.md).
    # The engine's GPU default when tokamax is installed (the `cuda13` extra).
    tokamax_moe: bool = False
    # FP8 linears (`Fp8Linear`) of decode steps (up to 64 rows, bf16) through the Pallas kernels
    # (pallas_kernels/linear: W8A16 weight streaming for a few rows, W8A8 on the FP8 tensor cores
    # for more; layers/linear.py) instead of XLA's dequantize-and-dot. The engine marks the
    # weights (`layers.linear.use_fp8_kernel`); GPU default.
    fp8_kernel: bool = False
    # With fp8_kernel, decode steps of 9-64 rows take the W8A8 kernel (Mosaic GPU, wgmma: Hopper);
    # off, the W8A16 kernel up to 16 rows and XLA beyond. The default on Hopper GPUs.
    fp8_w8a8: bool = False
    # With fp8_w8a8 (Hopper), NVFP4 linears of 2-1,024 rows through the 4-bit tensor-core kernel
    # (pallas_kernels/linear/w4_mgpu.py, as int4's) instead of the streaming kernel's dot path
    # (2-64 rows; 0.39x bf16's batch-64 step on the H100, session 36) and XLA's
    # dequantize-then-dot (prefill). H200, session 38: at 64 rows q|k|v 23.3 us and o 16.3 us
    # against the dot path's 73.1 / 56.2 (bf16 23.8 / 15.6); Llama-3-8B batch-64 device step
    # 6.86 ms (bench/results/*_s38_call*). On by default; False keeps session 36's paths.
    fp4_tensor_cores: bool = True
    # With fp8_kernel, one-row 4-bit linears take the decode layer's RMSNorms, SwiGLU, bias and
    # residual adds into the streaming kernel's launches (`linear_w4.w4_linear`: 495 -> 399
    # launches in a Llama-3-8B int4 batch-1 step). Off by default: on the H100 (session 41, one
    # call each way) the int4 device step stayed 2.78-2.83 ms against 2.82-2.83 and NVFP4's went
    # 3.07 -> 3.13 ms; the fused kernels took the removed launches' time. To measure on the H200.
    w4_fused_decode: bool = False
    # Ragged prefill attention through the Mosaic GPU kernel (paged_attention/prefill_mgpu.py:
    # TMA + wgmma, warp-specialized) where it supports the shape (bf16 pools, head_dim 64/128,
    # power-of-two GQA groups <= 16), else the Triton kernel; GPU default. H200: 1.2-1.5x the
    # Triton kernel (bench/results/session4_2026-11-30.md).
    mosaic_prefill: bool = False
    # The sampler skips its filters / random draw / top logprobs under `lax.cond` when no row of
    # the step needs them (`sampling.sample(branches=...)`): the CPU default. On the GPU XLA
    # evaluates a conditional's predicate on the host, so the next step could not be queued.
    sampler_branches: bool = False
    # The GPU's form of those skips: the same `lax.cond`s with the GPU's algorithms, in step
    # executables compiled with conditionals inside their CUDA graphs (`engine/compile.py`), where
    # the device evaluates the predicate: a greedy step without logprobs runs no filter, draw or
    # top-k (a batch-64 verify step's sampler: ~3.8 of 13.3 ms of kernels, H200, session 14).
    sampler_skip: bool = False
    # Decode and mixed steps whose rows follow no grammar launch one executable: the forward half
    # samples too (`step.jit_packed_forward`); the GPU default. Off: they launch the forward and the
    # sample halves back to back, as steps with grammar rows always do. A second launch cost
    # ~0.5 ms of host time a step on an H100 (session 49), which a one-row 4-bit step (2.6 ms on the
    # device) did not hide; on the CPU launches are cheap and the sampler inside every forward
    # half costs compile time (a test engine's: 18.7 s against 13.9).
    sample_in_forward: bool = False
    # XLA's rematerialization pass on the step executables. It counts the donated KV / SSM pools
    # against the device memory (a Llama-3-8B step "uses" 233 GiB of a 89 GiB limit on the H200),
    # so it always runs and recomputes fusions (norms twice, `*_remat` GEMM fusions) to save
    # memory that it cannot save; off = `xla_disable_hlo_passes=rematerialization`. Off in the
    # GPU default of LoRA engines (`engine.config.default_kernels`), where it recomputed GEMMs.
    xla_remat: bool = True
    # XLA's programmatic dependent launch on the GPU's step executables (`xla_gpu_enable_pdl`,
    # `xla_gpu_enable_pdl_launch`, in jaxlib 0.11.2's CUDA plugin): a kernel XLA emits may start
    # its prologue while the kernel before it drains (Hopper's griddepcontrol). At batch 1 a step
    # is a few hundred kernels of a few microseconds each. True / False force both on / off; None
    # leaves jaxlib's default, unchecked here (a note on OpenXLA's main says both are on by default
    # on Hopper). Not measured yet (session 37: the options exist; nothing run).
    xla_pdl: bool | None = None
    # Further XLA options of the step executables, as `Lowered.compile(compiler_options=...)`
    # takes them: ((name, value), ...) or a dict, over the ones above (e.g. the CPU tests that
    # run SmolLM2 for many steps: `(("xla_backend_optimization_level", 1),)` over the suite's 0).
    xla_options: tuple[tuple[str, bool | int | float | str], ...] = ()
    # The same for our Mosaic GPU linear kernels (Hopper; `pallas_kernels/linear/pdl.py`): the
    # W8A8 and 4-bit tensor-core GEMMs (decode steps of 2-64 rows, 4-bit prefill) launched with
    # PDL, each CTA's first weight tiles prefetched to L2 before it waits for the kernel that
    # writes its x, its dependents released after its main loop. Off: the first form (released
    # right after the wait) was 1.4-2.9x slower per kernel on an H100, this one 1.3-1.6x at one
    # row and up to 1.2x at 64 (int4 batch 64 through generate: 6.84 against 6.54 ms a step).
    kernel_pdl: bool = False
    # int4 linears with bf16 inputs through the 4-bit tensor-core GEMM's `promote` form (Hopper;
    # `pallas_kernels/linear/w4_mgpu.py`): the codes upcast to bf16 exactly (Mosaic GPU's int4
    # conversion), multiplied by x as they are, and only the f32 products scaled per row and group,
    # instead of each code converted to f32, scaled and rounded to bf16; one row too, instead of the
    # streaming kernel. More exact (no bf16 rounding of the weights). Off: slower on an H100
    # (session 44): 1.35-1.5x the streaming kernel's time at one row, +10% on a batch-64 step.
    w4_promote: bool = False
    # The sampler's threshold searches count through a Pallas kernel over rows x vocabulary chunks
    # (pallas_kernels/sampling) instead of XLA's one-block-per-row reductions (~0.57 ms of a
    # batch-64 Llama-3-8B step on the H200, session 16). Slower than those on the H200 (session 17,
    # bench/kernels/filter_ways.py): off by default.
    sampler_kernel: bool = False
    # Speculative verify windows through the decode kernel (`paged_verify_attention`: each row's
    # 1 + k queries as extra rows of its GQA group) instead of the ragged prefill kernel, where
    # the window's rows fit the kernel's tile (`verify_supports`). H200, Llama-3-8B, k = 4
    # (session 21): batch 64 13 us per layer against the Mosaic prefill kernel's 44 us, the
    # verify step 1.55-1.60x a decode step (1.62-1.69x); batch 1 1.01-1.05x (1.10-1.11x).
    verify_decode_kernel: bool = True
    # Tensor parallelism (metrale_jax/parallel.py): the `tp` mesh the step runs on. The Pallas
    # attention kernels then run per device on its heads under `shard_map`; None = one device.
    mesh: Any = None
    # LoRA deltas (engines built with enable_lora): "masked" (shrink against all slots, mask,
    # expand: two GEMMs), "gather" (each token's own A/B), "pallas" (steps of <= 64 tokens: the
    # expand, its add and the residual add as one kernel, pallas_kernels/linear/lora.py; masked
    # above) or "auto" (pallas where use_pallas, else gather when a step has fewer tokens than
    # slots, else masked); see metrale_jax/lora/ops.py
    lora_kernel: str = "auto"
    # Decode steps of fewer rows run the model on this many, the extra rows padding (as a bucket
    # pads), where every linear is a plain XLA dot and no layer routes to experts (`step.py`
    # checks): XLA's GEMMs stream weights faster at 8 rows than at 1 on the H200 (Llama-3-8B: the
    # four projections 3.84 ms per step at 1 row, 3.49 at 8; batch-1 step 4.70 -> 4.58 ms;
    # bench/results/session16_2026-12-02.md). The GPU default: 8.
    min_decode_rows: int = 1

    def __post_init__(self):
        # xla_options as ((name, value), ...) sorted by name (a dict or list of pairs given is
        # converted): the config is a static argument, hashed and compared
        opts = self.xla_options
        try:
            pairs = tuple(sorted(dict(opts).items()))
        except (TypeError, ValueError) as e:
            raise TypeError(f"AttentionConfig.xla_options: (name, value) pairs or a dict, got {opts!r}") from e
        bad = [k for k, v in pairs if not isinstance(k, str) or not isinstance(v, (bool, int, float, str))]
        if bad:
            raise TypeError(f"AttentionConfig.xla_options: names are strings and values bool, int, float or str; "
                            f"not {bad}")
        object.__setattr__(self, "xla_options", pairs)


def dense_causal_attention(q, k, v, lengths, scale, sliding_window=None):
    """Dense causal attention for the research forward.

    q [B, T, Hq, D], k/v [B, T, Hkv, D], lengths i32[B] (keys at index >= length are padding)
    -> [B, T, Hq, D] in q's dtype.
    """
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    qi = jnp.arange(t)[:, None]
    kj = jnp.arange(t)[None, :]
    mask = (kj <= qi)[None] & (kj[None] < lengths[:, None, None])  # [B, T, T]
    if sliding_window is not None:
        mask &= (qi - kj < sliding_window)[None]
    # Fold the T queries into the group axis: [B, Hkv, T*G, D].
    qb = q.reshape(b, t, hkv, hq // hkv, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, t * (hq // hkv), d)
    s = jnp.einsum("bhqd,bshd->bhqs", qb.astype(jnp.float32), k.astype(jnp.float32)) * scale
    s = s.reshape(b, hkv, t, hq // hkv, t)
    m5 = mask[:, None, :, None, :]
    s = jnp.where(m5, s, NEG_INF)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(m5, p, 0.0).reshape(b, hkv, t * (hq // hkv), t)
    o = jnp.einsum("bhqs,bshd->bhqd", p, v.astype(jnp.float32))
    o = o.reshape(b, hkv, t, hq // hkv, d).transpose(0, 2, 1, 3, 4).reshape(b, t, hq, d)
    return o.astype(q.dtype)


# The reference paths stream the keys in chunks of about this many tokens, up to the longest
# row's length (a loop with a dynamic trip count), so their cost follows the real context, not
# max_model_len: on the CPU, where they are the default, every prefill token used to be scored
# against max_prefill_streams x max_model_len keys (a 43-token chat prompt took 7-11 s to its
# first token with SmolLM2 at max_model_len 4096).
KEY_CHUNK = 256


def _stream_keys(cache: KVCache, layer, block_tables, kv_max, scores_fn, carry_shape):
    """Online softmax over the pages of `block_tables` i32[R, M], chunk by chunk, while the chunk
    starts below `kv_max` (traced). `scores_fn(k, v f32[R, C, Hkv, D], kpos i32[C])` returns the
    chunk's scores f32[carry_shape + (S,)], their mask (broadcastable) and `pv(p) -> f32[carry_shape
    + (D,)]`. Returns the normalized output f32[carry_shape + (D,)] (zeros where nothing is seen)."""
    r, m = block_tables.shape
    bs = cache.block_size
    ppc = max(1, min(m, KEY_CHUNK // bs))  # pages per chunk
    tables = jnp.pad(block_tables, ((0, 0), (0, (-m) % ppc)))  # padded pages are masked (kpos >= kv_max)
    d = cache.k.shape[-1]

    def body(j, carry):
        mx, den, acc = carry
        bt = jax.lax.dynamic_slice_in_dim(tables, j * ppc, ppc, axis=1)
        k, v = gather_kv(cache, layer, bt)  # [R, C, Hkv, D]
        kpos = j * ppc * bs + jnp.arange(ppc * bs)
        sc, mask, vv = scores_fn(k, v, kpos)
        new_mx = jnp.maximum(mx, jnp.max(jnp.where(mask, sc, NEG_INF), axis=-1, keepdims=True))
        pr = jnp.where(mask, jnp.exp(sc - new_mx), 0.0)
        alpha = jnp.exp(mx - new_mx)
        return new_mx, den * alpha + jnp.sum(pr, axis=-1, keepdims=True), acc * alpha + vv(pr)

    init = (jnp.full(carry_shape + (1,), NEG_INF, jnp.float32), jnp.zeros(carry_shape + (1,), jnp.float32),
            jnp.zeros(carry_shape + (d,), jnp.float32))
    n_chunks = (kv_max + ppc * bs - 1) // (ppc * bs)
    _, den, acc = jax.lax.fori_loop(0, jnp.minimum(n_chunks, tables.shape[1] // ppc), body, init)
    return acc / jnp.where(den == 0, 1.0, den)


def decode_attention_ref(q, cache: KVCache, layer, md: AttnMetadata, scale, sliding_window=None):
    """q [N, Hq, D] -> [N, Hq, D]. Row r attends to its first seq_lens[r] cached tokens."""
    n, hq, d = q.shape
    hkv = cache.k.shape[-2]
    qg = q.reshape(n, hkv, hq // hkv, d).astype(jnp.float32)

    def scores(k, v, kpos):  # k/v [N, C, Hkv, D]
        mask = kpos[None, :] < md.seq_lens[:, None]  # [N, C]
        if sliding_window is not None:
            mask &= kpos[None, :] > md.seq_lens[:, None] - 1 - sliding_window
        sc = jnp.einsum("rhgd,rchd->rhgc", qg, k) * scale
        return sc, mask[:, None, None, :], lambda pr: jnp.einsum("rhgc,rchd->rhgd", pr, v)

    o = _stream_keys(cache, layer, md.block_tables, jnp.max(md.seq_lens), scores, (n, hkv, hq // hkv))
    return o.reshape(n, hq, d).astype(q.dtype)


def prefill_attention_ref(q, cache: KVCache, layer, md: BatchedAttnMetadata, scale, sliding_window=None):
    """q [T, Hq, D] stacked in cu_seqlens order -> [T, Hq, D].

    Token t of stream b sits at position kv_lens[b] - n_b + (t - cu_seqlens[b]) and attends to its
    own stream's keys at positions <= that. Pad tokens (t >= cu_seqlens[-1]) give zeros.
    """
    t_tot, hq, d = q.shape
    b = md.block_tables.shape[0]
    hkv = cache.k.shape[-2]
    t = jnp.arange(t_tot)
    stream = jnp.clip(jnp.searchsorted(md.cu_seqlens, t, side="right", method="compare_all") - 1, 0, b - 1)  # i32[T]
    valid = t < md.cu_seqlens[-1]
    n_new = md.cu_seqlens[1:] - md.cu_seqlens[:-1]
    qpos = md.kv_lens[stream] - n_new[stream] + (t - md.cu_seqlens[stream])  # i32[T]
    own = jnp.arange(b)[None, :, None] == stream[:, None, None]  # [T, B, 1]
    qg = q.reshape(t_tot, hkv, hq // hkv, d).astype(jnp.float32)

    def scores(k, v, kpos):  # k/v [B, C, Hkv, D]: every stream's keys side by side
        causal = kpos[None, None, :] <= qpos[:, None, None]  # [T, 1, C]
        mask = own & causal & valid[:, None, None]
        if sliding_window is not None:
            mask &= kpos[None, None, :] > qpos[:, None, None] - sliding_window
        c = kpos.shape[0]
        kf, vf = k.reshape(b * c, hkv, d), v.reshape(b * c, hkv, d)
        sc = jnp.einsum("thgd,shd->thgs", qg, kf) * scale
        return sc, mask.reshape(t_tot, 1, 1, b * c), lambda pr: jnp.einsum("thgs,shd->thgd", pr, vf)

    o = _stream_keys(cache, layer, md.block_tables, jnp.max(md.kv_lens), scores, (t_tot, hkv, hq // hkv))
    return o.reshape(t_tot, hq, d).astype(q.dtype)


def _kernel_call(kernel, q, cache: KVCache, layer, tables: tuple, cfg: AttentionConfig):
    """kernel(q, k, v, layer, *tables, k_scale, v_scale) on one device, or on every device of
    `cfg.mesh` for its heads (`parallel.shard_heads`) when the KV heads divide over it."""
    fp8 = cache.k.dtype == jnp.float8_e4m3fn
    scales = (cache.k_scale[layer], cache.v_scale[layer]) if fp8 else (None, None)

    def call(q, k, v, layer, tables, scales):
        return kernel(q, k, v, layer, *tables, k_scale=scales[0], v_scale=scales[1])

    if cfg.mesh is not None:
        from metrale_jax.parallel import shard_heads

        return shard_heads(cfg.mesh, call, q, cache.k, cache.v, (layer, tables, scales))
    return call(q, cache.k, cache.v, layer, tables, scales)


def _pallas_takes(q, cache) -> bool:
    """Whether the Pallas attention kernels take this model's heads (a head_dim of 80 or 96, say,
    is not a power of two: the XLA reference runs those; static shapes, decided at trace time)."""
    from pallas_kernels.paged_attention.common import pools_supported

    return pools_supported(q, cache.k, cache.v)


def decode_attention(q, cache, layer, md, scale, cfg: AttentionConfig):
    """One query row a sequence: q [N, Hq, D] -> o [N, Hq, D] (the kernel, or the XLA reference)."""
    if cfg.use_pallas and _pallas_takes(q, cache):
        from pallas_kernels.paged_attention import paged_decode_attention

        kernel = functools.partial(paged_decode_attention, sm_scale=scale, sliding_window=cfg.sliding_window,
                                   interpret=cfg.interpret)
        return _kernel_call(kernel, q, cache, layer, (md.block_tables, md.seq_lens), cfg)
    return decode_attention_ref(q, cache, layer, md, scale, cfg.sliding_window)


def prefill_attention(q, cache, layer, md, scale, cfg: AttentionConfig):
    if cfg.use_pallas and _pallas_takes(q, cache):
        from pallas_kernels.paged_attention import (
            paged_prefill_attention,
            paged_verify_attention,
            prefill_mgpu,
            verify_supports,
        )

        tables = (md.block_tables, md.cu_seqlens, md.kv_lens)
        if cfg.verify_decode_kernel and verify_supports(q, cache.k, md.verify_width):
            kernel = functools.partial(paged_verify_attention, width=md.verify_width, sm_scale=scale,
                                       sliding_window=cfg.sliding_window, interpret=cfg.interpret)
        elif cfg.mosaic_prefill and prefill_mgpu.supports(q, cache.k, cache.v):
            def kernel(q, k, v, layer, *tables, k_scale, v_scale):
                return prefill_mgpu.paged_prefill_attention_mgpu(q, k, v, layer, *tables, sm_scale=scale,
                                                                 sliding_window=cfg.sliding_window,
                                                                 interpret=cfg.interpret)
        else:
            kernel = functools.partial(paged_prefill_attention, sm_scale=scale, sliding_window=cfg.sliding_window,
                                       interpret=cfg.interpret)
        return _kernel_call(kernel, q, cache, layer, tables, cfg)
    return prefill_attention_ref(q, cache, layer, md, scale, cfg.sliding_window)


def paged_attention(q, cache: KVCache, layer, dmd: AttnMetadata | None, pmd: BatchedAttnMetadata | None, scale,
                    cfg: AttentionConfig):
    """A step's attention: q [N + T, Hq, D] holds N decode rows, then T prefill tokens; each part
    goes to its own path (two launches measured faster than one ragged launch on the H200, see
    `pallas_kernels/paged_attention`). -> [N + T, Hq, D]."""
    n = dmd.num_seqs if dmd is not None else 0
    outs = []
    if dmd is not None:
        outs.append(decode_attention(q[:n], cache, layer, dmd, scale, cfg))
    if pmd is not None:
        outs.append(prefill_attention(q[n:], cache, layer, pmd, scale, cfg))
    return jnp.concatenate(outs) if len(outs) > 1 else outs[0]
