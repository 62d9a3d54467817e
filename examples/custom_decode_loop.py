"""Drive `decode_step` from your own jitted loop: prefill a prompt with `prefill_step`, then
generate N tokens in ONE jitted `lax.scan`, building the per-step metadata on the device.

The engine (`LLMEngine`) does all of this for many requests at once with a scheduler; this shows
the pure step functions underneath, for research loops (custom samplers, search, steering...).
Here the loop adds its own twist: tokens listed in --ban are forbidden (through the sampling
metadata's suppress list), and sampling is seeded per step, so the run is reproducible.

    python examples/custom_decode_loop.py --model tests/fixtures/data/llama_tiny --prompt-ids 5 17 33
    python examples/custom_decode_loop.py --prompt "The sea is" --temperature 0.8 --max-tokens 40
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metrale_jax import load_model  # noqa: E402
from metrale_jax.metadata import AttnMetadata  # noqa: E402
from metrale_jax.metadata_builder import (  # noqa: E402
    BuilderConfig,
    PrefillChunk,
    RowSampling,
    StepBucket,
    build_step,
)
from metrale_jax.sampling import seed_words  # noqa: E402
from metrale_jax.step import decode_step, init_step_state, prefill_step  # noqa: E402

BLOCK = 16


@functools.partial(jax.jit, static_argnames=("model", "steps", "table"), donate_argnums=1)
def decode_loop(params, state, first_token, prompt_len, smd, *, model, steps: int, table: int):
    """Generate `steps` tokens after `first_token` i32[] (at position `prompt_len`) for one
    sequence whose KV blocks are 0, 1, ..., table-1. Returns (state, i32[steps])."""

    def body(carry, i):
        state, tok = carry
        pos = (prompt_len + i)[None].astype(jnp.int32)  # i32[1]
        none = jnp.full((1,), -1, jnp.int32)
        md = AttnMetadata(
            positions=pos, positions_h=pos, positions_w=pos,
            slots=pos,  # blocks 0, 1, 2, ... in order, so the flat KV slot is the position
            seq_lens=pos + 1, block_tables=jnp.arange(table, dtype=jnp.int32)[None],
            ssm_slots=none, seq_slot=none, moe_row_adapter=none, num_seqs=1, max_blocks_per_seq=table,
        )
        row = dataclasses.replace(smd, out_index=(i + 1)[None].astype(jnp.int32))  # seeded per output index
        state, out = decode_step(params, state, md, tok[None], row, model=model, max_logprobs=1)
        return (state, out.token_ids[0]), out.token_ids[0]

    (state, _), toks = jax.lax.scan(body, (state, first_token), jnp.arange(steps))
    return state, toks


def generate(model, params, prompt: list[int], max_tokens: int, temperature: float = 0.0, seed: int = 0,
             ban: tuple[int, ...] = ()) -> list[int]:
    """Greedy (temperature 0) or seeded sampling of `max_tokens` tokens after `prompt`."""
    table = -(-(len(prompt) + max_tokens) // BLOCK)  # KV blocks for the whole sequence
    state = init_step_state(model, table, BLOCK)
    bcfg = BuilderConfig(block_size=BLOCK, max_blocks_per_seq=table, vocab_size=model.cfg.vocab_size,
                         max_suppress_ids=max(len(ban), 1))
    rs = RowSampling(temperature=temperature, seed=seed_words(seed, 0), suppress_ids=ban)
    # 1. prefill: one stream with every prompt token; it samples the first new token (row 0)
    bucket = StepBucket("prefill", num_tokens=len(prompt), num_streams=1)
    inp = build_step(bcfg, bucket, [], [PrefillChunk(prompt, 0, list(range(table)), sampling=rs)])
    prefill = jax.jit(prefill_step, static_argnames=("model", "max_logprobs"), donate_argnums=1)
    state, out = prefill(params, state, inp.pmd, inp.tokens, inp.smd, model=model, max_logprobs=1)
    # 2. the rest in one jitted scan, reusing that row's sampling metadata (1 decode token per step)
    smd = dataclasses.replace(inp.smd, tok_pen_rows=np.full(1, -1, np.int32), tok_is_output=np.ones(1, bool),
                              reset_rows=np.zeros(0, np.int32), prompt_lp_targets=np.zeros(0, np.int32))
    state, toks = decode_loop(params, state, out.token_ids[0], jnp.int32(len(prompt)), smd, model=model,
                              steps=max_tokens - 1, table=table)
    return [int(out.token_ids[0])] + [int(t) for t in np.asarray(toks)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompt", default=None)
    p.add_argument("--prompt-ids", type=int, nargs="*", default=None)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ban", type=int, nargs="*", default=[], help="token ids the loop may never emit")
    args = p.parse_args(argv)
    model, params = load_model(args.model, dtype="float32", show_progress=False)
    if args.prompt_ids:
        prompt = args.prompt_ids
    else:
        if model.tokenizer is None:
            p.error("this model has no tokenizer: pass --prompt-ids")
        prompt = model.tokenizer.encode(args.prompt or "The sea is")
    ids = generate(model, params, prompt, args.max_tokens, args.temperature, args.seed, tuple(args.ban))
    print("ids:", " ".join(map(str, ids)))
    if model.tokenizer is not None:
        print("text:", model.tokenizer.decode(ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
