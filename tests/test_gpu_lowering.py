"""Every step kind of the GPU's default configuration lowers for an H200, on the CPU.

The GPU's kernel choices (`config.default_kernels(on_gpu=True)`: the Pallas attention, scan and
FP8 / 4-bit decode kernels, the Mosaic GPU prefill where it applies, the branch-free sampler) are
cross-lowered to StableHLO for an abstract H200 (`lowering_platforms=("cuda",)`): a Triton or
Mosaic GPU lowering error, an unsupported op or layout, shows up here instead of on the GPU
machine (an NVFP4 scale load did, 2026-12-01). PTX generation and running still need the GPU.
Also checked: a step holds no conditional (`stablehlo.case`) but the sampler's three skips
(`AttentionConfig.sampler_skip`: the bitmask, the filters and draw, the top logprobs), which the
engine compiles into the step's CUDA graph (`engine.compile.COMMAND_BUFFER_WITH_CONDITIONALS`),
and the decode, prefill and mixed steps no while loop (`stablehlo.while`): XLA's GPU runtime
reads a plain conditional's predicate back to the host, and a while loop's too unless it knows
the trip count, and a step that waits on the host cannot be queued behind the previous one.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

from metrale_jax import load_model
from metrale_jax.engine.config import default_kernels
from metrale_jax.layers.linear import use_fp8_kernel
from metrale_jax.layers.stack import split_layers
from metrale_jax.metadata_builder import BuilderConfig, StepBucket, packed_layout
from metrale_jax.model import random_model
from metrale_jax.step import init_step_state, jit_packed_step
from tests.conftest import FIXTURES

BUCKETS = (StepBucket("decode", num_seqs=4), StepBucket("prefill", num_tokens=64, num_streams=2),
           StepBucket("mixed", num_seqs=4, num_tokens=64, num_streams=2),
           StepBucket("verify", num_seqs=4, num_spec=2))  # speculative decoding's verify step


def _h200_mesh():
    h200 = jax.sharding.AbstractDevice("NVIDIA H200", 132, "gpu")
    return jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=h200)


def _lower_steps(model, params, buckets=BUCKETS, **kernels) -> dict[str, str]:
    """StableHLO text of each step of `buckets` with the GPU's default kernels (`kernels` set over
    them), lowered for an H200."""
    attn = dataclasses.replace(default_kernels(on_gpu=True), **kernels)
    if attn.unroll_layers:  # as the engine prepares them for the GPU: per-layer arrays,
        params = split_layers(params)
    if attn.fp8_kernel:  # FP8 / 4-bit decode linears marked for their Pallas kernels
        params = use_fp8_kernel(params, w8a8=attn.fp8_w8a8, fp4_tensor_cores=attn.fp4_tensor_cores,
                                w4_fused_decode=attn.w4_fused_decode, pdl=attn.kernel_pdl, w4_promote=attn.w4_promote)
    sds = jax.ShapeDtypeStruct
    p = jax.tree.map(lambda a: sds(a.shape, a.dtype), params)
    slots = 8 if model.ssm_bytes_per_slot() > 0 else 0
    state = jax.eval_shape(lambda: init_step_state(model, 64, 16, max_ssm_slots=slots, penalty_rows=4))
    builder = BuilderConfig(block_size=16, max_blocks_per_seq=8, vocab_size=model.cfg.vocab_size, max_suppress_ids=4)
    mesh = _h200_mesh()
    out = {}
    for bucket in buckets:
        lay = packed_layout(builder, bucket)
        args = (p, state, sds((lay.num_i32,), jnp.int32), sds((lay.num_f32,), jnp.float32), sds((8,), jnp.int32),
                sds((bucket.num_sample_rows, -(-model.cfg.vocab_size // 32)), jnp.int32))
        with jax.sharding.use_abstract_mesh(mesh):
            traced = jit_packed_step(bucket.kind).trace(*args, layout=lay, model=model, attn=attn, max_logprobs=5,
                                                        placement=None)
            out[bucket.kind] = traced.lower(lowering_platforms=("cuda",)).as_text()
    return out


# (CI time: Qwen3-MoE, pure Mamba-2 and GPTQ, whose kernels the others lower too, are `slow`)
@pytest.mark.parametrize("name", ["llama_tiny", "qwen3_next_tiny", "nemotron_h_tiny", "llama_fp8_tiny",
                                  "llama_nvfp4_ct_tiny", "qwen3_moe_gptq_tiny"] +
                         [pytest.param(n, marks=pytest.mark.slow) for n in
                                                            ("qwen3_moe_tiny", "mamba2_tiny", "llama_gptq_tiny")])
def test_default_gpu_steps_lower_for_h200(name):
    model, params = load_model(FIXTURES / name, dtype="bfloat16", show_progress=False)
    texts = _lower_steps(model, params)
    for kind, text in texts.items():
        assert "__gpu$xla.gpu.triton" in text, (name, kind)  # the Pallas kernels, not the XLA reference
        assert text.count("stablehlo.case") == 3, (name, kind)  # the sampler's skips, nothing else
        # (the hybrids' verify steps keep a scan over the 1 + k window positions: a known trip count)
        assert kind == "verify" or "stablehlo.while" not in text, (name, kind)
    if "fp8" in name or "nvfp4" in name or "gptq" in name:  # the weight-streaming decode kernel
        assert "skinny_matmul" in texts["decode"] or "_w4_kernel" in texts["decode"], name
    if name == "qwen3_moe_gptq_tiny":  # 4-bit experts: XLA's gather and grouped GEMM (the expert kernel is opt-in)
        assert "expert_matvec_w4" not in texts["decode"] + texts["prefill"]


@pytest.mark.parametrize("name,quantization", [("qwen3_next_tiny", "fp8"), ("nemotron_h_tiny", "int4"),
                                               pytest.param("qwen3_next_tiny", "nvfp4", marks=pytest.mark.slow)])
def test_quantized_hybrid_steps_lower_for_h200(name, quantization):
    """The hybrids with every linear and expert quantized (FP8 / 4-bit: the Gated DeltaNet, Mamba and
    gated-attention projections through the Llama linears' kernels, session 42) lower for an H200."""
    model, params = load_model(FIXTURES / name, dtype="bfloat16", quantization=quantization, show_progress=False)
    texts = _lower_steps(model, params)
    kernel = "skinny_matmul" if quantization == "fp8" else "_w4_kernel"
    assert kernel in texts["decode"] and ("expert_matvec" in texts["decode"]) == (quantization == "fp8")
    for kind, text in texts.items():
        assert text.count("stablehlo.case") == 3, (name, kind)


def test_fp8_w8a8_steps_lower_at_any_rows():
    """FP8 linears of 9-64 rows take the W8A8 kernel (Mosaic GPU, TMA): decode steps of 20 rows
    (the last default bucket of max_num_seqs=20), verify steps of 4 rows with 2 drafts (12) and a
    mixed step of 4 decode rows beside 32 prompt tokens (36) are not whole 8-row TMA tiles, which
    failed to lower before the kernel padded them."""
    cfg = dict(architectures=["LlamaForCausalLM"], vocab_size=97, hidden_size=256, intermediate_size=384,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
               rope_theta=1000.0, max_position_embeddings=256, tie_word_embeddings=True)
    model, params = random_model(cfg, dtype="bfloat16", seed=0, quantization="fp8")
    texts = _lower_steps(model, params, buckets=(StepBucket("decode", num_seqs=20),
                                                 StepBucket("verify", num_seqs=4, num_spec=2),
                                                 StepBucket("mixed", num_seqs=4, num_tokens=32, num_streams=1)))
    for kind, text in texts.items():
        assert "skinny_matmul_w8a8_mgpu" in text, kind


@pytest.mark.parametrize("quantization,kernel", [("fp8", "skinny_matmul_w8a8_mgpu"), ("int4", "skinny_matmul_w4_mgpu")])
def test_kernel_pdl_steps_lower(quantization, kernel):
    """`kernel_pdl`: the Mosaic GPU linears of a 20-row decode step (W8A8, 4-bit tensor cores) lower
    with their L2 prefetches and grid-dependency wait, and Mosaic marks the kernels for a PDL
    launch (`mosaic_gpu.uses_pdl`); off (the default), neither."""
    cfg = dict(architectures=["LlamaForCausalLM"], vocab_size=97, hidden_size=256, intermediate_size=384,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
               rope_theta=1000.0, max_position_embeddings=256, tie_word_embeddings=True)
    model, params = random_model(cfg, dtype="bfloat16", seed=0, quantization=quantization)
    buckets = (StepBucket("decode", num_seqs=20),)
    on = _lower_steps(model, params, buckets=buckets, kernel_pdl=True)["decode"]
    off = _lower_steps(model, params, buckets=buckets)["decode"]
    assert kernel in on and kernel in off
    for marker in ("griddepcontrol.wait", "griddepcontrol.launch_dependents", "cp.async.bulk.prefetch", "uses_pdl"):
        assert marker in on and marker not in off, marker


@pytest.mark.parametrize("kernel", ["w8a8", "int4", "int4_promote", "fp4"])
def test_pdl_kernels_wait_before_and_release_after_the_main_loop(kernel, monkeypatch):
    """A PDL kernel's trace, in order: the L2 prefetches, the grid-dependency wait, every wgmma of
    its main loop, then the release of its dependents; only the tiles of the pipeline's first fill
    are prefetched. The first form (session 43: dependents released right after the wait, up to
    128 KB a CTA prefetched) was 1.4-2.9x slower on an H100 (session 44)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.linear.skinny_mgpu import MgpuParams, skinny_matmul_w8a8_mgpu
    from pallas_kernels.linear.w4_mgpu import W4MgpuParams, skinny_matmul_w4_mgpu

    events = []
    for name in ("async_prefetch", "griddepcontrol_wait", "wgmma", "griddepcontrol_launch_dependents"):
        def record(*a, _name=name, _f=getattr(plgpu, name), **kw):
            events.append(_name)
            return _f(*a, **kw)
        monkeypatch.setattr(plgpu, name, record)
    sds = jax.ShapeDtypeStruct
    m, n, k = 20, 512, 2048
    x = sds((m, k), jnp.bfloat16)
    if kernel == "w8a8":
        f = functools.partial(skinny_matmul_w8a8_mgpu, params=MgpuParams(split_k=2, pdl=True))
        args = (x, sds((n, k), jnp.float8_e4m3fn), sds((n // 128, k // 128), jnp.float32))
    elif kernel == "fp4":
        f = functools.partial(skinny_matmul_w4_mgpu, group_size=16, kind="fp4", params=W4MgpuParams(pdl=True))
        args = (x, sds((n, k // 2), jnp.uint8), sds((1, k // 16, n), jnp.float8_e4m3fn), sds((n,), jnp.float32))
    else:
        params = W4MgpuParams(pdl=True, promote=kernel == "int4_promote")
        f = functools.partial(skinny_matmul_w4_mgpu, group_size=128, params=params)
        args = (x, sds((n, k // 2), jnp.uint8), sds((2, k // 128, n), jnp.float32))
    with jax.sharding.use_abstract_mesh(_h200_mesh()):
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "uses_pdl" in text
    assert events.count("griddepcontrol_wait") == events.count("griddepcontrol_launch_dependents") == 1, events
    wait, release = events.index("griddepcontrol_wait"), events.index("griddepcontrol_launch_dependents")
    assert events[:wait] and set(events[:wait]) == {"async_prefetch"}, events
    assert "wgmma" in events[wait:release] and "wgmma" not in events[release:], events
    # only the pipeline's first fill (4 steps in flight, of 8-16), plus the 4-bit kernels' scale rows
    assert events.count("async_prefetch") == (4 if kernel == "w8a8" else 5), events


def test_w4_promote_steps_lower():
    """`w4_promote`: an int4 model's one-row and 20-row decode steps and its prefill step lower with
    every linear on the 4-bit tensor-core kernel (its promote form), none on the streaming kernel."""
    cfg = dict(architectures=["LlamaForCausalLM"], vocab_size=97, hidden_size=256, intermediate_size=384,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
               rope_theta=1000.0, max_position_embeddings=256, tie_word_embeddings=True)
    model, params = random_model(cfg, dtype="bfloat16", seed=0, quantization="int4")
    buckets = (StepBucket("decode", num_seqs=1), StepBucket("prefill", num_tokens=64, num_streams=2))
    for kind, text in _lower_steps(model, params, buckets=buckets, w4_promote=True).items():
        assert "skinny_matmul_w4_mgpu" in text and "_w4_kernel" not in text, kind
    one_row = _lower_steps(model, params, buckets=buckets[:1])["decode"]  # (the default: the streaming kernel)
    assert "skinny_matmul_w4_mgpu" not in one_row and "_w4_kernel" in one_row


def test_fp4_tensor_core_steps_lower():
    """`fp4_tensor_cores` (the default): NVFP4 linears of 2-1,024 rows take the 4-bit tensor-core
    kernel (Mosaic GPU) in every step kind, at row counts that are not whole 8-row tiles; without
    it, none."""
    cfg = dict(architectures=["LlamaForCausalLM"], vocab_size=97, hidden_size=256, intermediate_size=384,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
               rope_theta=1000.0, max_position_embeddings=256, tie_word_embeddings=True)
    model, params = random_model(cfg, dtype="bfloat16", seed=0, quantization="nvfp4")
    buckets = (StepBucket("decode", num_seqs=20), StepBucket("verify", num_seqs=4, num_spec=2),
               StepBucket("mixed", num_seqs=4, num_tokens=32, num_streams=1),
               StepBucket("prefill", num_tokens=64, num_streams=2))
    for kind, text in _lower_steps(model, params, buckets=buckets).items():
        assert "skinny_matmul_w4_mgpu" in text, kind
    for kind, text in _lower_steps(model, params, buckets=buckets[:1], fp4_tensor_cores=False).items():
        assert "skinny_matmul_w4_mgpu" not in text and "_w4_kernel" in text, kind


@pytest.mark.parametrize("quantization", ["int4", "nvfp4"])
def test_one_row_4bit_decode_step_fuses_its_layer(quantization):
    """`w4_fused_decode`: a one-row decode step with 4-bit weights, whose streaming kernel takes the
    norms, SwiGLU and residual adds into its launches (named after them), lowers for the H200;
    without it (the default) and at two rows nothing is fused."""
    cfg = dict(architectures=["LlamaForCausalLM"], vocab_size=97, hidden_size=256, intermediate_size=384,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
               rope_theta=1000.0, max_position_embeddings=256, tie_word_embeddings=True)
    model, params = random_model(cfg, dtype="bfloat16", seed=0, quantization=quantization)
    one, two = StepBucket("decode", num_seqs=1), StepBucket("decode", num_seqs=2)
    (text,) = _lower_steps(model, params, buckets=(one,), w4_fused_decode=True).values()
    assert all(f"skinny_matmul_w4_{f}" in text for f in ("norm", "res", "silu_res")), text.count("skinny_matmul")
    for bucket, fused in ((two, True), (one, False)):  # (two rows: the tensor-core kernel)
        (text,) = _lower_steps(model, params, buckets=(bucket,), w4_fused_decode=fused).values()
        assert "_w4_kernel" in text or "skinny_matmul_w4_mgpu" in text
        assert not any(f"skinny_matmul_w4_{f}" in text for f in ("norm", "res", "silu"))

@pytest.mark.parametrize("head_dim", [80, 96])
def test_head_dims_the_attention_kernels_do_not_take(head_dim):
    """A head_dim that is not a power of two: every step still lowers for the H200 (before, the
    attention kernels' check stopped it), attention through XLA's reference, the rest Pallas."""
    cfg = dict(architectures=["LlamaForCausalLM"], vocab_size=97, hidden_size=256, intermediate_size=384,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
               rms_norm_eps=1e-6, rope_theta=1000.0, max_position_embeddings=256, tie_word_embeddings=True)
    model, params = random_model(cfg, dtype="bfloat16", seed=0)
    for kind, text in _lower_steps(model, params).items():
        assert "paged_decode_attention" not in text and "paged_prefill_attention" not in text, kind
        assert "rope_and_write_kv" in text, kind  # (the Pallas K/V write pads D to a power of two)


def test_mosaic_prefill_lowers_for_h200():
    """head_dim 64, bf16 pools: the prefill and mixed steps take the Mosaic GPU prefill kernel; the
    verify step takes the decode kernel (`paged_verify_attention`), or the Mosaic kernel with
    `verify_decode_kernel` off."""
    cfg = dict(architectures=["Qwen3ForCausalLM"], vocab_size=97, hidden_size=128, intermediate_size=96,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6,
               rope_theta=1000.0, max_position_embeddings=256, tie_word_embeddings=True)
    model, params = random_model(cfg, dtype="bfloat16", seed=0)
    texts = _lower_steps(model, params)
    assert "mosaic_gpu" not in texts["decode"]
    assert all("mosaic_gpu" in texts[k] for k in ("prefill", "mixed"))
    assert "mosaic_gpu" not in texts["verify"] and "paged_decode_attention" in texts["verify"]
    verify = _lower_steps(model, params, verify_decode_kernel=False)["verify"]
    assert "mosaic_gpu" in verify and "paged_decode_attention" not in verify


def test_opt_in_kernels_lower_for_h200():
    """The LoRA expand-add kernel and the kernel not on by default yet (the searches' counting
    kernel) lower to Triton for an H200, alone at their sizes and inside the steps of a bf16 Llama."""
    from pallas_kernels.linear.lora import lora_expand_add
    from pallas_kernels.sampling import sums_ge

    sds = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    with jax.sharding.use_abstract_mesh(_h200_mesh()):
        for t in (1, 64):
            y = sds((t, 6144 + 8 * 48), bf)
            f = jax.jit(functools.partial(lora_expand_add, h_offset=6144, parts=(4096, 1024, 1024)))
            text = f.trace(y, y, sds((t,), jnp.int32), sds((8, 48, 6144), bf)).lower(lowering_platforms=("cuda",))
            assert "lora_expand_add" in text.as_text()
            # gate|up with its SwiGLU activation, from the f32 product and the norm's row scale
            y = sds((t, 2 * 14336 + 8 * 32), jnp.float32)
            f = jax.jit(functools.partial(lora_expand_add, h_offset=28672, parts=(14336, 14336),
                                          silu_mul=True, norm=(1e-5, 4096), out_dtype=bf))
            text = f.trace(y, y, sds((t,), jnp.int32), sds((8, 32, 28672), bf), None,
                           sds((t,), jnp.float32)).lower(lowering_platforms=("cuda",))
            assert "lora_expand_add" in text.as_text()
        for r in (1, 320):
            x = sds((r, 128256), jnp.float32)
            text = jax.jit(sums_ge).trace(x, sds((r, 15), jnp.float32), x).lower(lowering_platforms=("cuda",)).as_text()
            assert "sums_ge" in text
    model, params = load_model(FIXTURES / "llama_tiny", dtype="bfloat16", show_progress=False)
    texts = _lower_steps(model, params, sampler_kernel=True)
    assert all("sums_ge" in t and t.count("stablehlo.case") == 3 for t in texts.values())
