"""A fake model and tokenizer with the engine's model interface, for fast engine/server tests.

`FakeModel` compiles in a fraction of a second yet exercises everything the engine relies on:
the paged cache (it stores each token id at its KV slot and reads the whole sequence back through
the block tables), chunked prefill (`cu_seqlens`, `kv_lens`), decode rows, padding, and
optionally the SSM pool (per-slot state carried across chunks, decode steps and swaps).

Its next token is a pure function of the sequence so far, `fake_next_token`:
    h = sum_j (ids[j] + 1) * (j + 1)  mod V        (over every token up to the current position)
    logits = W[h]   (W f32[V, V], the params)
so a host loop gives the exact greedy continuation a correct engine must produce, whatever the
batching, chunking or preemption. With SSM state on, each slot holds
    acc   i32[]   the running sum above (h gets 2 * acc on top of the sum read from the cache),
    count i32[]   the number of tokens it has seen, checked against each token's position,
    tail  i32[2]  the previous two tokens + 1 (0 = none), like a conv state: h += 5 * t1 + 11 * t2,
so h = 3 * sum + 5 * (ids[-2] + 1) + 11 * (ids[-3] + 1). A missing reset, a wrong slot, a state
restored stale, zeroed or into another slot (a swap bug) changes the tokens; a count that does not
match the position adds 13 to h for good.

`FakeTokenizer` maps token ids to single characters (id 0 "<pad>", 1 "</s>" special), enough for
detokenization and stop strings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax.cache.ssm import SSMArraySpec, init_ssm_pool, read_slots, ssm_bytes_per_slot, write_slots
from metrale_jax.config import ModelConfig

ALPHABET = "  abcdefghijklmnopqrstuvwxyz0123456789.,!?ABCDEFGHIJKLMNOPQRSTUVWXYZ-:;"


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class FakeState:
    cache: jax.Array  # i32[num_blocks, block_size]  the token id at each KV slot
    # when use_ssm: {"fake": {"acc": i32[max_slots], "count": i32[max_slots], "tail": i32[max_slots, 2]}}
    ssm: dict = field(default_factory=dict)

    @property
    def block_size(self) -> int:
        return self.cache.shape[1]


class FakeTokenizer:
    """id i <-> ALPHABET[i] (ids 0, 1 are the special "<pad>" and "</s>")."""

    eos_token_ids = (1,)
    chat_template = None

    def __init__(self, vocab_size: int):
        self.vocab = vocab_size

    def _ch(self, i: int) -> str:
        if i == 0:
            return "<pad>"
        if i == 1:
            return "</s>"
        return ALPHABET[i % len(ALPHABET)] if i < len(ALPHABET) else chr(0x100 + i)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        out = []
        for ch in text:
            i = ALPHABET.find(ch, 2)
            out.append(i if 0 <= i < self.vocab else 2)
        return out

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self._ch(int(i)) for i in ids if not (skip_special_tokens and self.is_special(int(i))))

    def is_special(self, i: int) -> bool:
        return int(i) in (0, 1)

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True, **kw):  # (transformers')
        s = "".join(f"{m['role'][0]}:{m['content']};" for m in messages) + ("a:" if add_generation_prompt else "")
        return self.encode(s) if tokenize else s


@dataclass(frozen=True)
class FakeModel:
    """The engine's model interface over a token-id "KV cache" (see module docstring)."""

    vocab_size: int = 64
    max_position_embeddings: int = 512
    use_ssm: bool = False
    with_tokenizer: bool = True
    name: str = "fake"
    dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = (1,)

    @property
    def cfg(self) -> ModelConfig:
        return ModelConfig(architecture="Fake", vocab_size=self.vocab_size, hidden_size=self.vocab_size,
                           intermediate_size=1, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=1,
                           max_position_embeddings=self.max_position_embeddings,
                           eos_token_ids=self.eos_token_ids)

    @property
    def tokenizer(self):
        return FakeTokenizer(self.vocab_size) if self.with_tokenizer else None

    def init_params(self, seed: int = 0) -> dict:
        w = np.random.default_rng(seed).standard_normal((self.vocab_size, self.vocab_size)) * 3
        return {"w": jnp.asarray(w, jnp.float32)}

    @property
    def ssm_spec(self) -> dict:
        if not self.use_ssm:
            return {}
        return {"fake": {"acc": SSMArraySpec((), "int32"), "count": SSMArraySpec((), "int32"),
                         "tail": SSMArraySpec((2,), "int32")}}

    def swap_roles(self, state: FakeState) -> list:
        """Per leaf of `state`: the cache is indexed by block (axis 0), the SSM rows by slot."""
        return [("block", 0)] + [("slot", 0)] * len(jax.tree.leaves(state.ssm))

    def init_state(self, num_blocks: int, block_size: int, kv_dtype=None, max_ssm_slots: int = 0,
                   extra_kv_layers: int = 0) -> FakeState:  # (no MTP head: extra_kv_layers stays 0)
        ssm = init_ssm_pool(self.ssm_spec, max_ssm_slots) if self.use_ssm else {}
        return FakeState(jnp.zeros((num_blocks, block_size), jnp.int32), ssm)

    def kv_bytes_per_block(self, block_size: int, kv_dtype=None, extra_kv_layers: int = 0) -> int:
        return 4 * block_size

    def ssm_bytes_per_slot(self) -> int:
        return ssm_bytes_per_slot(self.ssm_spec)

    def forward_paged(self, params, state: FakeState, tokens, dmd, pmd, attn=None):
        """tokens i32[N + T] -> (state, hidden f32[N + T, V] one-hot of h)."""
        v = self.vocab_size
        nb, bs = state.cache.shape
        parts = [m for m in (dmd, pmd) if m is not None]
        slots = jnp.concatenate([m.slots for m in parts])
        flat = state.cache.reshape(-1)
        flat = flat.at[jnp.where(slots >= 0, slots, nb * bs)].set(tokens, mode="drop")
        cache = flat.reshape(nb, bs)
        hs, ssm = [], state.ssm
        if dmd is not None:
            ctx = cache[dmd.block_tables].reshape(dmd.num_seqs, -1)  # [N, M*bs]
            pos = jnp.arange(ctx.shape[1])[None, :]
            h = jnp.sum(jnp.where(pos < dmd.seq_lens[:, None], (ctx + 1) * (pos + 1), 0), axis=1)
            if self.use_ssm:
                tok1 = tokens[: dmd.num_seqs] + 1
                st = read_slots(ssm["fake"], dmd.ssm_slots)
                fresh = (dmd.seq_lens <= 1)[:, None]
                st = {k: jnp.where(fresh.reshape((-1,) + (1,) * (v.ndim - 1)), 0, v) for k, v in st.items()}
                acc = st["acc"] + tok1 * (dmd.positions + 1)
                ok = st["count"] == dmd.positions
                h = h + 2 * acc + 5 * st["tail"][:, 1] + 11 * st["tail"][:, 0] + jnp.where(ok, 0, 13)
                new = {"acc": acc, "count": st["count"] + 1,
                       "tail": jnp.stack([st["tail"][:, 1], tok1], axis=1)}
                ssm = {"fake": write_slots(ssm["fake"], dmd.ssm_slots, new)}
            hs.append(h)
        if pmd is not None:
            t_tot = pmd.num_tokens
            n = dmd.num_seqs if dmd is not None else 0
            t = jnp.arange(t_tot)
            b = pmd.num_streams
            stream = jnp.clip(jnp.searchsorted(pmd.cu_seqlens, t, side="right", method="compare_all") - 1, 0, b - 1)
            valid = t < pmd.cu_seqlens[-1]
            n_new = pmd.cu_seqlens[1:] - pmd.cu_seqlens[:-1]
            qpos = pmd.kv_lens[stream] - n_new[stream] + (t - pmd.cu_seqlens[stream])
            ctx = cache[pmd.block_tables].reshape(b, -1)[stream]  # [T, M*bs]
            pos = jnp.arange(ctx.shape[1])[None, :]
            h = jnp.sum(jnp.where(pos <= qpos[:, None], (ctx + 1) * (pos + 1), 0), axis=1)
            if self.use_ssm:
                tok1 = tokens[n:] + 1  # i32[T]
                contrib = jnp.where(valid, tok1 * (pmd.positions + 1), 0)
                start = pmd.kv_lens - n_new  # i32[B]; a stream starting at 0 resets its state
                st = read_slots(ssm["fake"], pmd.ssm_slots)
                st = {k: jnp.where((start == 0).reshape((-1,) + (1,) * (v.ndim - 1)), 0, v) for k, v in st.items()}
                cs = jnp.cumsum(contrib)
                base = jnp.concatenate([jnp.zeros((1,), cs.dtype), cs])[pmd.cu_seqlens[:-1]]  # [B]
                acc_tok = st["acc"][stream] + cs - base[stream]
                i = t - pmd.cu_seqlens[stream]  # offset in the chunk
                prev1 = jnp.concatenate([jnp.zeros((1,), tok1.dtype), tok1[:-1]])
                prev2 = jnp.concatenate([jnp.zeros((2,), tok1.dtype), tok1[:-2]])
                tail = st["tail"][stream]  # [T, 2]
                t1 = jnp.where(i >= 1, prev1, tail[:, 1])
                t2 = jnp.where(i >= 2, prev2, jnp.where(i == 1, tail[:, 1], tail[:, 0]))
                ok = st["count"][stream] + i == pmd.positions
                h = h + 2 * acc_tok + 5 * t1 + 11 * t2 + jnp.where(ok, 0, 13)
                if pmd.verify_width:  # a verify step: the state after every token to the scratch
                    from metrale_jax.layers.spec_states import SCRATCH

                    rows = jnp.where(valid, stream * pmd.verify_width + i, -1)
                    per_tok = {"acc": acc_tok, "count": st["count"][stream] + i + 1,
                               "tail": jnp.stack([t1, tok1], axis=1)}
                    ssm = {**ssm, SCRATCH: {"fake": write_slots(ssm[SCRATCH]["fake"], rows, per_tok)}}
                else:
                    last = jnp.clip(pmd.cu_seqlens[1:] - 1, 0, t_tot - 1)
                    new = {"acc": acc_tok[last], "count": st["count"] + n_new,
                           "tail": jnp.stack([t1[last], tok1[last]], axis=1)}
                    slots_w = jnp.where(n_new > 0, pmd.ssm_slots, -1)
                    ssm = {"fake": write_slots(ssm["fake"], slots_w, new)}
            hs.append(jnp.where(valid, h, 0))
        h = jnp.concatenate(hs) % v
        return FakeState(cache, ssm), jax.nn.one_hot(h, v, dtype=jnp.float32)

    def compute_logits(self, params, hidden):
        return hidden @ params["w"]

    def replace(self, **kw) -> FakeModel:
        return dataclasses.replace(self, **kw)


def fake_hash(ids, use_ssm: bool, vocab: int) -> int:
    ids = np.asarray(ids, np.int64)
    h = int(np.sum((ids + 1) * (np.arange(len(ids)) + 1)))
    if use_ssm:
        h = 3 * h + (5 * int(ids[-2] + 1) if len(ids) >= 2 else 0) + (11 * int(ids[-3] + 1) if len(ids) >= 3 else 0)
    return h % vocab


def fake_next_token(w: np.ndarray, ids, use_ssm: bool = False) -> int:
    """The greedy next token of `FakeModel` after the tokens `ids`."""
    return int(np.argmax(w[fake_hash(ids, use_ssm, w.shape[0])]))


def fake_greedy(w: np.ndarray, prompt, max_tokens: int, eos: tuple[int, ...] = (1,), use_ssm: bool = False,
                ignore_eos: bool = False, max_len: int | None = None, presence_penalty: float = 0.0) -> list[int]:
    """Reference greedy generation of FakeModel (stops on eos unless ignore_eos); with a
    presence penalty subtracted from the float32 logits of the tokens generated so far."""
    ids = list(prompt)
    out = []
    while len(out) < max_tokens and (max_len is None or len(ids) < max_len):
        if presence_penalty:
            x = w[fake_hash(ids, use_ssm, w.shape[0])].astype(np.float32).astype(np.float64)
            x[np.unique(np.asarray(out, np.int64))] -= presence_penalty
            t = int(np.argmax(x))
        else:
            t = fake_next_token(w, ids, use_ssm)
        out.append(t)
        ids.append(t)
        if t in eos and not ignore_eos:
            break
    return out


FAKE_ENGINE_CONFIG = dict(
    max_model_len=128, block_size=4, num_kv_blocks=96, max_num_seqs=4, max_num_batched_tokens=16,
    decode_buckets=(2, 4), mixed_decode_buckets=(4,), prefill_buckets=(8, 16), max_prefill_streams=2,
    max_logprobs=5, max_suppress_ids=4, show_progress=False,
)

_ENGINES: dict = {}


def fake_engine(use_ssm: bool = True, **overrides):
    """A (cached) LLMEngine over FakeModel with tiny buckets; a few seconds to compile once.

    Callers must leave it idle (no requests left) and restore `engine.scheduler` if they swap it.
    """
    from metrale_jax.engine.config import EngineConfig
    from metrale_jax.engine.engine import LLMEngine

    key = (use_ssm, tuple(sorted(overrides.items())))
    if key not in _ENGINES:
        model = FakeModel(use_ssm=use_ssm)
        cfg = EngineConfig(**{**FAKE_ENGINE_CONFIG, **overrides})
        _ENGINES[key] = LLMEngine(model, model.init_params(), cfg)
    return _ENGINES[key]


# ---- a tokenizer for models without one ------------------------------------------------------------
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def piece(i: int) -> str:
    """Token i's text: a letter and a number ("a0", "b0", ..., "a1", ...), unique per id."""
    return f"{_LETTERS[i % 26]}{i // 26}"


def synthetic_tokenizer(vocab_size: int, eos_ids: tuple[int, ...]):
    """A `metrale_jax.loading.tokenizer.Tokenizer` over the whole vocabulary of a random-weight or
    tiny fixture model: token i decodes to `piece(i)`, EOS ids to special tokens "<eos{i}>"
    (skipped in text). Its byte-level decoder lets llguidance build structured-output masks."""
    from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel

    from metrale_jax.loading.tokenizer import Tokenizer

    vocab = {(f"<eos{i}>" if i in eos_ids else piece(i)): i for i in range(vocab_size)}
    tok = HFTokenizer(WordLevel(vocab=vocab, unk_token=piece(0) if 0 not in eos_ids else piece(1)))
    # text splits into its pieces (a letter starts each), so "b3c4" encodes to [79, 106]: the
    # grammar matcher tokenizes the text it forces
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[a-z][0-9]+"), behavior="isolated")
    tok.decoder = decoders.ByteLevel()  # (pieces are ASCII: bytes as they are; llguidance reads it)
    specials = [f"<eos{i}>" for i in eos_ids if i < vocab_size]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return Tokenizer(tok, eos_token=specials[0] if specials else None)
