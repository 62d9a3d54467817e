"""Tensor parallelism against one device, for tests/test_tensor_parallel.py.

Run in a fresh process with N simulated CPU devices (the XLA flag is process-wide):

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m tests.tp_check [--family llama_tiny --variant 4]

A variant is a device count, optionally with `:ep` (MoE experts split by expert) or `:pallas`
(the Pallas kernels in interpret mode, the attention kernels under `shard_map`); without
`--variant`, each family runs the variants of `PLAN` (`--plan ci`: `CI_PLAN`'s). For each family
fixture the same requests (greedy with logprobs and prompt logprobs, a seeded top-p sample with a repetition penalty, a
prompt longer than the token budget so it prefills in chunks, and more requests than the KV pool
holds at once so sequences are preempted) run through `LLM.generate` on one device (the XLA
reference) and on each variant; prints one JSON line per (family, variant) with the largest
logprob difference, and exits 1 when ids differ or a logprob differs by more than `--atol`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

# every family at TP=2; TP=4 where the KV heads divide (llama) and where they do not (Qwen3-Next:
# 2 KV heads, replicated); expert parallelism; the Pallas kernels
# (`--variant 2:spec`: speculative decoding, k = 3, drafts from the reference outputs, some corrupted;
# not in the plan for test time: test_two_processes_match_one's slow case covers it)
# not tests.conftest's: importing it turns on JAX's persistent cache, which two processes of one run
# must not write at once
FIXTURES = Path(__file__).parent / "fixtures" / "data"

PLAN = {"llama_tiny": ("2", "4", "2:pallas", "2:features"), "qwen3_tiny": ("2",), "qwen3_moe_tiny": ("2", "2:ep"),
        "qwen3_next_tiny": ("2", "4"), "nemotron_h_tiny": ("2",), "mamba2_tiny": ("2",),
        "llama_gptq_tiny": ("2", "4"), "llama_nvfp4_ct_tiny": ("2",), "qwen3_moe_gptq_tiny": ("2", "2:ep")}
# what CI runs (`--plan ci`): the features (prefix caching, LoRA, the server; the Pallas kernels
# under shard_map are check_shard_heads' and PLAN's; Mamba-2 across two processes is
# test_two_processes_match_one's); the rest is PLAN's (slow), replicated KV heads at TP=4 with GDN
# and MoE included (CI's until session 15, whose CI ran 2,067 s)
CI_PLAN = {"llama_tiny": ("2:features",)}


def _config(tp: int, expert_parallel: bool, interpret_kernels: bool, features: bool = False):
    from metrale_jax.engine.config import EngineConfig
    from metrale_jax.layers.attention import AttentionConfig

    attention = AttentionConfig(use_pallas=True, interpret=True) if interpret_kernels else None
    extra = dict(enable_prefix_caching=True, enable_lora=True, max_loras=2, max_lora_rank=8) if features else {}
    return EngineConfig(**extra,dtype="float32", max_model_len=96, block_size=8, num_kv_blocks=20, max_num_seqs=4,
                        max_num_batched_tokens=32, decode_buckets=(4,), prefill_buckets=(32,), max_prefill_streams=2,
                        max_logprobs=3, show_progress=False, compilation_cache_dir=None, attention=attention,
                        swap_block_buckets=(12,), tensor_parallel_size=tp, enable_expert_parallel=expert_parallel)


def _requests(vocab: int):
    from metrale_jax.sampling import SamplingParams

    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, vocab, n).tolist() for n in (5, 70, 17, 33, 9)]
    params = [SamplingParams(temperature=0, max_tokens=12, logprobs=3, prompt_logprobs=2),
              SamplingParams(temperature=0, max_tokens=20, logprobs=1),  # 70 + 20 tokens: chunked prefill
              SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.2, seed=5, max_tokens=16, logprobs=1),
              SamplingParams(temperature=0, max_tokens=24, logprobs=1),
              SamplingParams(temperature=1.0, top_k=8, seed=9, max_tokens=24, logprobs=1)]
    return [{"prompt_token_ids": p} for p in prompts], params


def run_family(family: str, tp: int, expert_parallel: bool, interpret_kernels: bool, follower: bool = False,
               features: bool = False, spec_refs: list | None = None):
    """The requests through `LLM.generate` -> ([(ids, logprobs + prompt logprobs f64[...])], stats);
    None on a follower process (which runs the leader's steps until it is done). `features`: also
    with prefix caching and LoRA adapters (tests/fixtures/data/lora), a second turn that hits the
    cache, one completion through the HTTP server, and two structured-output requests (a choice,
    greedy and sampled; the model gets `synthetic_tokenizer`). `spec_refs`: the reference outputs, for
    speculative decoding with drafts taken from them (some corrupted)."""
    from metrale_jax import LLM, load_model
    from metrale_jax.engine.engine import LLMEngine
    from metrale_jax.parallel import Sharder, make_mesh

    # at TP > 1 the loader streams each parameter to its shards (as LLMEngine.from_config does)
    sharder = Sharder(make_mesh(tp), expert_parallel=expert_parallel) if tp > 1 else None
    model, params = load_model(FIXTURES / family, dtype="float32", show_progress=False, sharder=sharder)
    if features:  # a tokenizer over the fixture's vocabulary, for structured output
        import dataclasses

        from metrale_jax.engine.testing import synthetic_tokenizer

        model = dataclasses.replace(model, tokenizer=synthetic_tokenizer(model.cfg.vocab_size,
                                                                         tuple(model.eos_token_ids)))
    cfg = _config(tp, expert_parallel, interpret_kernels, features)
    if spec_refs is not None:
        from metrale_jax.engine import spec_decode
        from tests.test_spec_decode import _oracle, _oracle_ahead

        cfg = cfg.replace(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
        prompts, _ = _requests(int(model.cfg.vocab_size))
        refs = [p["prompt_token_ids"] + r for p, (r, _) in zip(prompts, spec_refs)]
        spec_decode.draft_tokens = _oracle(refs, int(model.cfg.vocab_size))
        spec_decode.draft_past_inflight = _oracle_ahead(refs, int(model.cfg.vocab_size))
    eng = LLMEngine(model, params, cfg)
    if follower:
        eng.follow_leader()
        return None
    prompts, sps = _requests(int(model.cfg.vocab_size))
    llm = LLM.from_engine(eng)
    if features:
        from metrale_jax import LoRARequest

        lora = [LoRARequest(n, i + 1, str(FIXTURES / "lora" / family / n)) for i, n in enumerate("ab")]
        first = llm.generate(prompts, sps, use_tqdm=False, lora_request=[lora[0], None, lora[1], lora[0], None])
        # the next turn of the first conversations: their prompts and replies come back from the cache
        again = (0, 2, 3)
        turn2 = [{"prompt_token_ids": first[i].prompt_token_ids + first[i].outputs[0].token_ids + [7]} for i in again]
        outs = first + llm.generate(turn2, [sps[i] for i in again], use_tqdm=False,
                                    lora_request=[lora[0], lora[1], lora[0]])
        assert eng.stats().prefix_cache_hits > 0
        outs[-1].outputs[0].token_ids = outs[-1].outputs[0].token_ids + _served(eng, turn2[-1], lora[0])
        # structured output: the grammar's masks over the (vocabulary-sharded) logits
        from metrale_jax.sampling import SamplingParams
        from metrale_jax.structured_output import StructuredOutputsParams

        choice = StructuredOutputsParams(choice=["b3c4d5", "e6", "f7g8"])
        so = llm.generate(prompts[:2], [SamplingParams(temperature=t, seed=3, max_tokens=8, logprobs=1,
                                                       structured_outputs=choice) for t in (0.0, 1.0)],
                          use_tqdm=False)
        assert all(o.outputs[0].text in choice.choice for o in so), [o.outputs[0].text for o in so]
        outs += so
    else:
        outs = llm.generate(prompts, sps, use_tqdm=False)
    eng.release_followers()
    res = []
    for o in outs:
        c = o.outputs[0]
        lps = [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)]
        plp = [d[t].logprob for d, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])] if o.prompt_logprobs else []
        res.append((c.token_ids, np.asarray(lps + plp)))
    return res, eng.stats()


def _served(eng, prompt: dict, adapter) -> list[int]:
    """One greedy completion of `prompt` with `adapter` (a LoRARequest) through the HTTP server
    -> its token ids."""
    import httpx

    from metrale_jax.server.app import ServerConfig
    from metrale_jax.server.runner import BackgroundServer

    cfg = ServerConfig(model_names=("tiny",), lora_modules=(adapter,))
    with BackgroundServer(eng, cfg) as srv:
        r = httpx.post(srv.url + "/v1/completions", timeout=120, json=dict(
            model=adapter.lora_name, prompt=prompt["prompt_token_ids"], max_tokens=6, temperature=0, logprobs=1))
    r.raise_for_status()
    toks = r.json()["choices"][0]["logprobs"]["tokens"]  # "token_id:N" without a tokenizer, else the text
    return [int(t.split(":")[1]) if t.startswith("token_id:") else eng.model.tokenizer.token_to_id(t) for t in toks]


def check_shard_heads() -> None:
    """`parallel.shard_heads` hands each device its own heads (and the gathered ones when they do
    not divide)."""
    import jax
    import jax.numpy as jnp

    from metrale_jax.parallel import make_mesh, shard_heads

    mesh, seen = make_mesh(2), []

    def fn(q, k, v, layer, tables):
        seen.append((q.shape[1], k.shape[-2]))
        return q * 2 + k[layer].sum() * 0 + tables[0].sum() * 0

    q, k = jnp.ones((3, 4, 8)), jnp.ones((2, 5, 4, 2, 8))
    out = jax.jit(lambda q, k: shard_heads(mesh, fn, q, k, k, (1, (jnp.arange(3),))))(q, k)
    assert seen == [(2, 1)] and bool((out == 2).all()), seen
    seen.clear()
    shard_heads(mesh, fn, jnp.ones((3, 3, 8)), k, k, (1, (jnp.arange(3),)))  # 3 heads: not split
    assert seen == [(3, 2)], seen


def check_streamed_loading() -> None:
    """`load_model(sharder=...)` gives the parameters of a plain load, each placed as the rules
    say, stacked or per layer (dense, MoE with and without expert parallelism, 4-bit linears (GPTQ
    act-order, NVFP4), FP8 linears and FP8 experts, the hybrids)."""
    import jax

    from metrale_jax import load_model
    from metrale_jax.layers.stack import host_stacked
    from metrale_jax.parallel import Sharder, make_mesh

    for family, ep in (("llama_fp8_tiny", False), ("qwen3_moe_fp8_tiny", True), ("qwen3_moe_tiny", False),
                       ("qwen3_next_tiny", False), ("nemotron_h_tiny", True), ("llama_gptq_tiny", False),
                       ("llama_nvfp4_ct_tiny", False)):
        _, want = load_model(FIXTURES / family, dtype="float32", show_progress=False)
        for split in (False, True):
            sharder = Sharder(make_mesh(2), expert_parallel=ep)
            _, got = load_model(FIXTURES / family, dtype="float32", show_progress=False, split_layers=split,
                                sharder=sharder)
            placed = jax.tree_util.tree_leaves_with_path(got)
            assert placed and all(x.sharding == sharder.param_sharding(p, x) for p, x in placed), family
            assert any(len(x.sharding.device_set) == 2 and not x.sharding.is_fully_replicated for _, x in placed)
            for (p, w), g in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(host_stacked(got))):
                np.testing.assert_array_equal(np.asarray(w), g, err_msg=f"{family} {jax.tree_util.keystr(p)}")


def main(argv=None) -> int:
    import jax

    jax.config.update("jax_enable_compilation_cache", False)  # see FIXTURES above
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", action="append", default=None)
    ap.add_argument("--variant", action="append", default=None, help="N, N:ep or N:pallas")
    ap.add_argument("--atol", type=float, default=1e-4)
    ap.add_argument("--plan", choices=("full", "ci"), default="full")
    args = ap.parse_args(argv)
    check_shard_heads()
    check_streamed_loading()
    ok = True
    plan = CI_PLAN if args.plan == "ci" else PLAN
    for fam in args.family or list(plan):
        variants = args.variant or plan[fam]
        want, _ = run_family(fam, 1, False, False)  # one device, the XLA reference
        if any(v.endswith(":features") for v in variants):
            want_features, _ = run_family(fam, 1, False, False, features=True)
        for variant in variants:
            tp, _, how = variant.partition(":")
            got, stats = run_family(fam, int(tp), how == "ep", how == "pallas", features=how == "features",
                                    spec_refs=want if how == "spec" else None)
            ref = want_features if how == "features" else want
            same_ids = len(got) == len(ref) and all(g[0] == w[0] for g, w in zip(got, ref))
            diff = max(float(np.max(np.abs(g[1] - w[1]), initial=0.0)) for g, w in zip(got, ref))
            print(json.dumps(dict(family=fam, variant=variant, same_ids=same_ids, max_logprob_diff=diff,
                                  preemptions=stats.num_preemptions)), flush=True)
            ok &= same_ids and diff <= args.atol
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
