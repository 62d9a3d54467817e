"""Tokenizer, chat template and incremental detokenizer, against transformers' outputs.

The real-model tests read the SmolLM2-135M-Instruct GGUF (skipped, with the reason, when it cannot
be fetched) and compare with `tests/fixtures/data/smollm2_golden.json`, written by transformers
5.24 (`AutoTokenizer.from_pretrained(..., gguf_file=...)`).
"""

from __future__ import annotations

import json
import random
from datetime import datetime

import jinja2
import pytest

from metrale_jax.errors import LoadError
from metrale_jax.loading.tokenizer import IncrementalDetokenizer, Tokenizer
from tests._smollm2 import smollm2_checkpoint, smollm2_gguf, smollm2_golden, smollm2_tokenizer  # noqa: F401

# ---- SmolLM2 against the golden file --------------------------------------------------------------


def test_tokenizer_cases_match_transformers(smollm2_tokenizer, smollm2_golden):  # noqa: F811
    tok = smollm2_tokenizer
    cases = smollm2_golden["tokenizer_cases"]
    assert len(cases) >= 8
    for c in cases:
        assert tok.encode(c["text"]) == c["ids"], c["text"]
        assert tok.encode(c["text"], add_special_tokens=False) == c["ids_no_special"], c["text"]
        # Round trip: the text comes back exactly (special tokens kept when asked).
        assert tok.decode(c["ids"], skip_special_tokens=False) == c["text"]


def test_prompts_and_chat_template_match_transformers(smollm2_tokenizer, smollm2_golden):  # noqa: F811
    tok, g = smollm2_tokenizer, smollm2_golden
    assert tok.chat_template == g["chat_template"]
    assert tok.eos_token_ids == tuple(g["eos_token_ids"]) and tok.bos_token_id == g["bos_token_id"]
    d = g["add_special_tokens_default"]
    assert not d["adds_bos"] and not d["adds_eos"]
    kinds = set()
    for c in g["cases"]:
        if "messages" in c:
            kinds.add("chat")
            rendered = tok.apply_chat_template(c["messages"], add_generation_prompt=True, tokenize=False)
            assert rendered == c["rendered"]
            assert tok.apply_chat_template(c["messages"], add_generation_prompt=True) == c["prompt_token_ids"]
            assert tok.encode(rendered, add_special_tokens=False) == c["prompt_token_ids"]
        else:
            kinds.add("plain")
            assert tok.encode(c["text"]) == c["prompt_token_ids"] == d["with_default"]
            assert tok.encode(c["text"], add_special_tokens=False) == d["without"]
        assert tok.decode(c["greedy_ids"]) == c["greedy_text"]
    assert kinds == {"chat", "plain"}


def test_smollm2_basics(smollm2_tokenizer):  # noqa: F811
    tok = smollm2_tokenizer
    assert tok.vocab_size == 49152
    assert tok.convert_ids_to_tokens([1, 2, 19556]) == ["<|im_start|>", "<|im_end|>", "Hello"]
    assert tok.id_to_token(0) == "<|endoftext|>" and tok.token_to_id("<|im_end|>") == 2
    assert tok.is_special(2) and not tok.is_special(19556)
    assert tok.decode([1, 4093, 2]) == "user" and tok.decode([1, 4093, 2], skip_special_tokens=False) == (
        "<|im_start|>user<|im_end|>")
    # SmolLM2's hub tokenizer.json pre-tokenizes with Sequence[Digits(individual_digits), ByteLevel],
    # as llama.cpp's "smollm" pre-type does: digits are split off before GPT-2's regex, so a run of
    # spaces before a digit stays one token. (transformers' GGUF converter has no "smollm" entry
    # and gives [216, 216, 38, 35] here; the hub tokenizer and llama.cpp give ours.)
    assert tok.encode("  63") == [256, 38, 35]
    assert tok.encode("x 2024") == [104, 216, 34, 32, 34, 36]


def test_transformers_names(smollm2_tokenizer, smollm2_golden):  # noqa: F811
    """What scripts written against transformers' tokenizer call on `LLM.get_tokenizer()` (vLLM
    returns transformers' own): apply_chat_template's defaults (no generation prompt, token ids),
    calling it, batch_decode, get_vocab, convert_tokens_to_ids, all_special_ids."""
    tok = smollm2_tokenizer
    case = next(c for c in smollm2_golden["cases"] if "messages" in c)
    with_prompt = case["prompt_token_ids"]  # (transformers', add_generation_prompt=True)
    plain = tok.apply_chat_template(case["messages"])
    assert isinstance(plain, list) and len(plain) < len(with_prompt) and with_prompt[: len(plain)] == plain
    assert tok.decode(with_prompt[len(plain):], skip_special_tokens=False) == "<|im_start|>assistant\n"
    assert tok("Hello, world!") == {"input_ids": tok.encode("Hello, world!"), "attention_mask": [1] * 4}
    assert tok(["a b", "c"], add_special_tokens=False)["input_ids"] == [tok.encode("a b"), tok.encode("c")]
    assert tok.batch_decode([[19556], [1, 4093, 2]]) == ["Hello", "user"]
    vocab = tok.get_vocab()
    assert len(vocab) == tok.vocab_size and vocab["Hello"] == 19556 and vocab["<|im_end|>"] == 2
    assert tok.convert_tokens_to_ids("Hello") == 19556
    assert tok.convert_tokens_to_ids(["<|im_start|>", "user"]) == [1, 4093]
    assert {0, 1, 2} <= set(tok.all_special_ids) and 19556 not in tok.all_special_ids


# ---- from_dir ------------------------------------------------------------------------------------


def test_from_dir_reproduces_gguf_tokenizer(tmp_path, smollm2_tokenizer, smollm2_golden):  # noqa: F811
    src = smollm2_tokenizer
    src.backend.save(str(tmp_path / "tokenizer.json"))
    cfg = {"bos_token": {"content": "<|im_start|>", "special": True}, "eos_token": "<|im_end|>",
           "chat_template": src.chat_template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_dir(tmp_path)
    for c in smollm2_golden["tokenizer_cases"]:
        assert tok.encode(c["text"]) == c["ids"]
    assert (tok.bos_token_id, tok.eos_token_ids, tok.chat_template) == (1, (2,), src.chat_template)
    # add_bos_token in tokenizer_config rebuilds the post-processor, as transformers does.
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": True}))
    assert Tokenizer.from_dir(tmp_path).encode("Hello, world!") == [1, 19556, 28, 905, 17]
    assert Tokenizer.from_dir(tmp_path).encode("Hello, world!", add_special_tokens=False) == [19556, 28, 905, 17]
    # chat_template.jinja wins over the config's template.
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    hi = [{"role": "user", "content": "hi"}]
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(hi, tokenize=False) == "hi!"


def test_tokenizer_without_template_raises(tmp_path, smollm2_tokenizer):  # noqa: F811
    smollm2_tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.chat_template is None and tok.eos_token_ids == ()
    with pytest.raises(LoadError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


# ---- chat-template environment (expected strings rendered by transformers 5.24) --------------------
TEMPLATE = """{%- set ns = namespace(n=0) -%}
{{ bos_token }}
{%- for m in messages %}
    {%- if m.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role: ' + m.role) }}{% endif %}
    {% if m.role == 'assistant' %}
<a>{% generation %}{{ m.content }}{% endgeneration %}</a>{{ eos_token }}
    {% else %}
<{{ m.role }}>{{ m.content | tojson }}
    {% endif %}
    {%- set ns.n = ns.n + 1 %}
    {%- if ns.n >= 3 %}{% break %}{% endif %}
{%- endfor %}
{%- if tools %}
{{ tools | tojson(indent=2) }}
{% endif %}
{%- if add_generation_prompt %}<a>{% endif %}
{{- extra_var | default('none') }}
"""
MESSAGES = [
    {"role": "system", "content": 'Be <brief> & "exact".'},
    {"role": "user", "content": "<b>café & 東京</b>\n  two spaces"},
    {"role": "assistant", "content": "Sure: 🙂"},
    {"role": "user", "content": "never rendered (loop break)"},
]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"x": "ü<>&"}}}]
# transformers.PreTrainedTokenizerFast(bos_token="<|im_start|>", eos_token="<|im_end|>").apply_chat_template(
#     MESSAGES, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True, tools=TOOLS, extra_var="X")
WANT_GEN = (
    '<|im_start|><system>"Be <brief> & \\"exact\\"."\n<user>"<b>café & 東京</b>\\n  two spaces"\n'
    "<a>Sure: 🙂</a><|im_end|>\n"
    '[\n  {\n    "type": "function",\n    "function": {\n      "name": "f",\n      "parameters": {\n'
    '        "x": "ü<>&"\n      }\n    }\n  }\n]\n<a>X'
)
# ... (MESSAGES[:2], add_generation_prompt=False)
WANT_NOGEN = '<|im_start|><system>"Be <brief> & \\"exact\\"."\n<user>"<b>café & 東京</b>\\n  two spaces"\nnone'


def test_chat_template_environment_matches_transformers(smollm2_tokenizer):  # noqa: F811
    tok = smollm2_tokenizer
    got = tok.apply_chat_template(MESSAGES, chat_template=TEMPLATE, add_generation_prompt=True, tools=TOOLS,
                                  extra_var="X", tokenize=False)
    assert got == WANT_GEN
    assert tok.apply_chat_template(MESSAGES[:2], chat_template=TEMPLATE, tokenize=False) == WANT_NOGEN
    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role: tool"):
        tok.apply_chat_template([{"role": "user", "content": "x"}, {"role": "tool", "content": "x"}],
                                chat_template=TEMPLATE)
    # The sandbox refuses attribute escapes.
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([], chat_template="{{ ''.__class__.__mro__ }}")
    year = datetime.now().strftime("%Y")
    assert tok.apply_chat_template([], chat_template="{{ strftime_now('%Y') }}", tokenize=False) in (
        year, str(int(year) + 1))


def test_continue_final_message(smollm2_tokenizer):  # noqa: F811
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello the"}]
    out = smollm2_tokenizer.apply_chat_template(msgs, continue_final_message=True, tokenize=False)
    assert out.endswith("<|im_start|>assistant\nHello the")


# ---- incremental detokenization ------------------------------------------------------------------
_POOL = (list("abcdefgh xyz,.!?'\n\t0123456789") + ["é", "ß", "ü", "東", "京", "語", "한", "국", "Д", "π", "🙂", "🚀",
                                                   "👍🏽", "\u200b", "  ", " the", " a"])


def _random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(_POOL) for _ in range(n))


def test_incremental_detokenizer_matches_full_decode(smollm2_tokenizer):  # noqa: F811
    tok = smollm2_tokenizer
    rng = random.Random(0)
    split_chars = 0
    for trial in range(60):
        prompt = tok.encode(_random_text(rng, rng.randint(0, 12)))
        text = _random_text(rng, rng.randint(1, 40))
        ids = tok.encode(text)
        # Count tokens that end inside a multi-byte character (decoding alone gives U+FFFD).
        split_chars += sum("\ufffd" in tok.decode([i]) for i in ids)
        det = IncrementalDetokenizer(tok, prompt)
        deltas = [det.add(i) for i in ids]
        assert "".join(deltas) == det.text == tok.decode(ids) == text, (trial, text)
        assert not any("\ufffd" in d for d in deltas)
    assert split_chars > 20  # the streams really did split characters across tokens


def test_incremental_detokenizer_special_tokens(smollm2_tokenizer):  # noqa: F811
    tok = smollm2_tokenizer
    ids = tok.encode("Hi 🙂<|im_end|>\n<|im_start|>there", add_special_tokens=False)
    det = IncrementalDetokenizer(tok, tok.encode("<|im_start|>assistant\n"))
    for i in ids:
        det.add(i)
    assert det.text == tok.decode(ids) == "Hi 🙂\nthere"
    det = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    for i in ids:
        det.add(i)
    assert det.text == "Hi 🙂<|im_end|>\n<|im_start|>there"


def test_incremental_detokenizer_flush_incomplete(smollm2_tokenizer):  # noqa: F811
    tok = smollm2_tokenizer
    ids = tok.encode("ok 🚀")
    det = IncrementalDetokenizer(tok, [])
    out = "".join(det.add(i) for i in ids[:-1])  # stop mid-character
    assert out == "ok" or out == "ok "
    assert out + det.flush() == tok.decode(ids[:-1])  # the incomplete bytes come out as U+FFFD


def _window_decode(det: IncrementalDetokenizer) -> IncrementalDetokenizer:
    det._stream = None  # the Python window decode only
    return det


def _compare_stream_and_window(tok, rng: random.Random, trials: int) -> int:
    """Random prompt and output ids (bytes split anywhere, special tokens too): the Rust stream and
    the window decode give the same deltas, flush and text. -> trials that used the stream."""
    used = 0
    for trial in range(trials):
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 8))]
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))]
        skip = rng.random() < 0.7
        a = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        b = _window_decode(IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip))
        used += a._stream is not None
        assert [a.add(i) for i in ids] == [b.add(i) for i in ids], (trial, prompt, ids)
        assert a.flush() == b.flush() and a.text == b.text, (trial, prompt, ids)
    return used


def test_incremental_detokenizer_stream_matches_window_decode(smollm2_tokenizer):  # noqa: F811
    assert _compare_stream_and_window(smollm2_tokenizer, random.Random(1), 60) > 40


class _SentencePieceLike:
    """A byte-fallback BPE with SentencePiece's "▁" spaces (Llama-2 / Mistral style), trained here,
    behind the three members the detokenizer uses."""

    def __init__(self):
        from tokenizers import SentencePieceBPETokenizer

        t = SentencePieceBPETokenizer()
        rng = random.Random(2)
        t.train_from_iterator([_random_text(rng, 60) for _ in range(300)], vocab_size=400,
                              special_tokens=["<unk>", "</s>"], initial_alphabet=[], show_progress=False)
        self.backend = t._tokenizer
        self.vocab_size = self.backend.get_vocab_size()

    def decode(self, ids, skip_special_tokens=True):
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def is_special(self, i):
        return int(i) == 1

    def encode(self, text):
        return self.backend.encode(text).ids


def test_incremental_detokenizer_stream_sentencepiece_like():
    tok = _SentencePieceLike()
    assert _compare_stream_and_window(tok, random.Random(3), 60) > 40
    rng = random.Random(4)
    ctx = tok.encode("say:")
    assert len(ctx) <= IncrementalDetokenizer._INITIAL_OFFSET
    for _ in range(20):  # a text's ids after the prompt: what they add to the prompt's decoded text
        ids = tok.encode(_random_text(rng, rng.randint(1, 30)))
        det = IncrementalDetokenizer(tok, ctx)
        assert det._stream is not None
        out = "".join(det.add(i) for i in ids) + det.flush()
        assert out == tok.decode(ctx + ids)[len(tok.decode(ctx)):]


def test_incremental_detokenizer_stream_failure_continues_with_windows(smollm2_tokenizer):  # noqa: F811
    """The library's stream raising mid-output (its "invalid prefix" error) hands over to the window
    decode at the same offsets: the text is the same as a window decode's all along."""
    tok = smollm2_tokenizer
    rng = random.Random(5)

    class Failing:
        def __init__(self, inner, after):
            self.inner, self.left = inner, after

        def step(self, backend, ids):
            if self.left == 0:
                raise RuntimeError("Invalid prefix encountered")
            self.left -= 1
            return self.inner.step(backend, ids)

    for trial in range(20):
        prompt = tok.encode(_random_text(rng, 6))
        ids = tok.encode(_random_text(rng, 40))
        a = IncrementalDetokenizer(tok, prompt)
        assert a._stream is not None
        a._stream = Failing(a._stream, rng.randint(0, len(ids) - 1))
        b = _window_decode(IncrementalDetokenizer(tok, prompt))
        assert [a.add(i) for i in ids] == [b.add(i) for i in ids], trial
        assert a._stream is None and a.text == b.text == tok.decode(ids)
