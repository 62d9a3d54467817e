"""Request validation of the offline API (`LLM.generate` / `LLM.chat` over `LLMEngine.validate`):
text the tokenizer cannot take, malformed chat messages, chat-template failures and max_tokens
beyond the context each raise a named `InvalidRequestError` before anything is queued, and the
engine serves the next request as if nothing had happened.

The engine is `FakeModel`'s (a few seconds to compile; its greedy continuation is known exactly,
`fake_greedy`) with a real `tokenizers` tokenizer and jinja chat template put in its place
(test_server_support.make_tiny_text_model, vocabulary 256 = the fake model's).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_server_support import make_tiny_text_model

from metrale_jax.engine.config import EngineConfig
from metrale_jax.engine.engine import LLMEngine
from metrale_jax.engine.testing import FAKE_ENGINE_CONFIG, FakeModel, fake_greedy
from metrale_jax.errors import (
    ChatTemplateError,
    InvalidMessagesError,
    InvalidPromptError,
    InvalidRequestError,
    MaxTokensTooLargeError,
    PromptTooLongError,
)
from metrale_jax.llm import LLM
from metrale_jax.loading.tokenizer import Tokenizer
from metrale_jax.sampling import SamplingParams

VOCAB = 256
MML = FAKE_ENGINE_CONFIG["max_model_len"]  # 128
GREEDY = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model = FakeModel(vocab_size=VOCAB, use_ssm=False)
    eng = LLMEngine(model, model.init_params(), EngineConfig(**FAKE_ENGINE_CONFIG))
    eng.tokenizer = Tokenizer.from_dir(make_tiny_text_model(tmp_path_factory.mktemp("tok") / "m"))
    yield LLM.from_engine(eng)
    assert not eng.has_unfinished_requests()


@pytest.fixture(scope="module")
def W(llm):
    return np.asarray(llm.llm_engine.params["w"], np.float64)


def assert_serves(llm, W, text: str = "still fine?") -> None:
    """Nothing is queued, and a good request gives the exact greedy continuation."""
    eng = llm.llm_engine
    assert not eng.has_unfinished_requests() and eng.stats().kv_blocks_used == 0
    ids = llm.tokenizer.encode(text)
    out = llm.generate([text], GREEDY)[0]
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == fake_greedy(W, ids, 7, ignore_eos=True)


# ---- prompts the tokenizer cannot take -------------------------------------------------------------
@pytest.mark.parametrize("prompt", ["bad \udcff byte", "\udcc3", "ok then \ud800"])
def test_non_utf8_prompt_is_named_error(llm, W, prompt):
    # "bad \udcff byte" is what Python makes of the argument $'bad \xff byte' (surrogateescape)
    with pytest.raises(InvalidPromptError, match="not valid UTF-8") as e:
        llm.generate([prompt], GREEDY)
    assert "surrogate" in str(e.value) and not isinstance(e.value.__cause__, TypeError)
    # in a batch: the good prompt before it is not queued either
    with pytest.raises(InvalidPromptError):
        llm.generate(["fine", prompt], GREEDY)
    assert_serves(llm, W)


def test_other_tokenizer_failures_are_named_errors(llm, W, monkeypatch):
    def broken(text, add_special_tokens=True):
        raise RuntimeError("the Rust side said no")

    monkeypatch.setattr(llm.tokenizer, "encode", broken)
    with pytest.raises(InvalidPromptError, match="RuntimeError: the Rust side said no"):
        llm.generate(["anything"], GREEDY)
    monkeypatch.undo()
    for bad in [{"prompt_token_ids": "abc"}, {"prompt_token_ids": [1, "x"]}, {"prompt_token_ids": [2**70]},
                {"prompt_token_ids": [VOCAB]}, 3.5]:
        with pytest.raises(InvalidPromptError):
            llm.generate([bad], GREEDY)
    assert_serves(llm, W)


# ---- chat messages and templates ----------------------------------------------------------------------
BAD_MESSAGES = [
    ([{"role": "user"}], "has no 'content'"),
    ([{"content": "hi"}], "string 'role'"),
    ([{"role": 3, "content": "hi"}], "string 'role'"),
    ([{"role": "user", "content": 5}], "content must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "content parts"),
    ([{"role": "user", "content": [{"type": "text"}]}], "content parts"),
    (["hello"], "list of message dicts"),
    ([{"role": "user", "content": "ok"}, "hello"], r"messages\[1\] must be a dict"),
    ([], "non-empty"),
    ("hello", "non-empty list"),
    ([[{"role": "user", "content": "ok"}], [{"role": "user"}]], r"messages\[1\]\[0\]"),
]


@pytest.mark.parametrize("messages,match", BAD_MESSAGES)
def test_bad_chat_messages_are_named_errors(llm, W, messages, match):
    with pytest.raises(InvalidMessagesError, match=match):
        llm.chat(messages, GREEDY)
    assert_serves(llm, W)


@pytest.mark.parametrize("template,match", [
    ("{{ raise_exception('no system messages here') }}", "no system messages here"),
    ("{% for m in messages %}{{ m.content + 1 }}{% endfor %}", "TypeError"),
    ("{{ messages[0].content | nosuchfilter }}", "nosuchfilter"),
    ("{% for m in messages %}{{ m.missing.deeper }}{% endfor %}", "UndefinedError"),
])
def test_chat_template_errors_are_named_errors(llm, W, template, match):
    with pytest.raises(ChatTemplateError, match=match) as e:
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, chat_template=template)
    assert "chat template" in str(e.value)
    assert_serves(llm, W)


def test_good_chat_renders_content_parts_and_none(llm, W):
    conv = [{"role": "system", "content": None},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    out = llm.chat(conv, GREEDY)[0]
    want = llm.tokenizer.apply_chat_template([{"role": "system", "content": ""}, {"role": "user", "content": "a\nb"}],
                                             add_generation_prompt=True)
    assert out.prompt_token_ids == want and want[:2] == [4, llm.tokenizer.encode("s", add_special_tokens=False)[0]]
    assert out.outputs[0].token_ids == fake_greedy(W, want, 7, ignore_eos=True)
    with pytest.raises(InvalidPromptError):  # lone surrogates inside a message
        llm.chat([{"role": "user", "content": "bad \udcff"}], GREEDY)
    assert_serves(llm, W)


# ---- max_tokens beyond the context ----------------------------------------------------------------
@pytest.mark.parametrize("n_prompt", [1, 37, MML - 1])
def test_max_tokens_beyond_context_is_rejected_like_vllm(llm, W, n_prompt):
    ids = np.random.default_rng(n_prompt).integers(6, VOCAB, n_prompt).tolist()
    room = MML - n_prompt
    for too_many in (room + 1, 100_000):
        with pytest.raises(MaxTokensTooLargeError) as e:
            llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=too_many))
        assert str(e.value).startswith(
            f"This model's maximum context length is {MML} tokens. However, you requested {n_prompt + too_many} "
            f"tokens ({n_prompt} in the prompt, {too_many} for the completion).")
        assert isinstance(e.value, InvalidRequestError) and e.value.code == "context_length_exceeded"
    assert not llm.llm_engine.has_unfinished_requests()
    # exactly the room left fits, and None means "up to the context": both stop at max_model_len
    for mt in (room, None):
        o = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=mt,
                                                                     ignore_eos=True))[0].outputs[0]
        assert o.finish_reason == "length" and o.token_ids == fake_greedy(W, ids, room, ignore_eos=True)


def test_prompt_too_long_still_its_own_error(llm):
    with pytest.raises(PromptTooLongError):
        llm.generate([{"prompt_token_ids": [7] * MML}], SamplingParams(max_tokens=None))
