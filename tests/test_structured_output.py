"""Structured output: the device-side bitmask against llguidance's own numpy reference, the sampler
under a mask, request validation, and the real SmolLM2 GGUF constrained by a nested JSON schema, a
regex and a choice list, through `LLM.generate` and through the HTTP server with the `openai`
client (`response_format`). Every JSON output must parse and validate (`jsonschema`)."""

from __future__ import annotations

import functools
import json
import re
import threading

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from metrale_jax.errors import InvalidSamplingParamsError, InvalidStructuredOutputsError
from metrale_jax.metadata_builder import BuilderConfig, RowSampling, sampling_only
from metrale_jax.sampling import SamplingParams, apply_token_bitmask, init_penalty_state, sample
from metrale_jax.structured_output import GrammarCompiler, StructuredOutputsParams, packed_width
from tests._smollm2 import fast_cpu_steps, smollm2_checkpoint, smollm2_gguf, smollm2_tokenizer  # noqa: F401

llg_numpy = pytest.importorskip("llguidance.numpy")

# nested objects, an array, enums, integers and numbers
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "weight": {"type": "number", "minimum": 0, "maximum": 100},
        "owner": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                   "vip": {"type": "boolean"}},
                  "required": ["city", "vip"], "additionalProperties": False},
        "toys": {"type": "array", "items": {"enum": ["ball", "rope", "bell"]}, "maxItems": 2},
    },
    "required": ["name", "kind", "age", "weight", "owner", "toys"],
    "additionalProperties": False,
}


# ---- the device side ----------------------------------------------------------------------------
def _bits(rng, rows: int, vocab: int, p: float) -> np.ndarray:
    allowed = rng.random((rows, packed_width(vocab) * 32)) < p
    return np.packbits(allowed, axis=1, bitorder="little").view(np.int32)  # i32[rows, W]


@pytest.mark.parametrize("vocab", [100, 128, 1000])
def test_apply_token_bitmask_matches_llguidance(vocab):
    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal((5, vocab)).astype(np.float32)
    mask = _bits(rng, 5, vocab, 0.3)
    mask[1] = -1  # an unconstrained row
    mask[3, 0] = 0  # a word with nothing allowed, and one with everything
    mask[3, -1] = -1
    ref = logits.copy()
    llg_numpy.apply_token_bitmask_inplace(ref, mask)
    got = np.asarray(jax.jit(apply_token_bitmask)(logits, mask))
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(got[1], logits[1])  # bit for bit


@pytest.mark.parametrize("branches", [False, True])
def test_sample_obeys_the_mask(branches):
    v, rows = 300, 7
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((rows, v)).astype(np.float32) * 3)
    mask = _bits(rng, rows, v, 0.1)
    mask[5] = -1  # free row
    cfg = BuilderConfig(block_size=16, max_blocks_per_seq=1, vocab_size=v)
    # rows 0-4 grammars; row 5 free; row 6 a mask that is no grammar (allowed_token_ids, say)
    kinds = [dict(grammar=True), dict(temperature=1.0, grammar=True), dict(temperature=0.8, top_p=0.9, grammar=True),
             dict(temperature=1.5, top_k=20, grammar=True), dict(temperature=1.0, min_p=0.05, grammar=True), dict(),
             dict()]
    allowed = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[:, :v].astype(bool)
    fn = jax.jit(lambda x, smd, m: sample(x, smd, init_penalty_state(0, v), max_logprobs=3, branches=branches,
                                          bitmask=m))
    free = jax.jit(lambda x, smd: sample(x, smd, init_penalty_state(0, v), max_logprobs=3, branches=branches))
    for seed in range(10):
        smd = sampling_only(cfg, [RowSampling(seed=(seed, 0, r), logprobs=True, **k) for r, k in enumerate(kinds)])
        tok, lp, _, top_ids, top_lp = fn(logits, smd, mask)
        tok = np.asarray(tok)
        assert all(allowed[r, tok[r]] for r in range(rows)), (seed, tok)
        ref = np.where(allowed[0], np.asarray(logits[0]), -np.inf)
        assert tok[0] == np.argmax(ref)  # greedy: the best allowed token
        # logprobs are of the masked distribution (vLLM applies the grammar before its sampler)
        np.testing.assert_allclose(lp[0], jax.nn.log_softmax(ref)[tok[0]], rtol=1e-5)
        assert np.all(allowed[0, np.asarray(top_ids[0])] | np.isneginf(np.asarray(top_lp[0])))
        # an unconstrained row samples what it samples without any mask
        assert tok[5] == int(free(logits, smd)[0][5])
        # a mask that is no grammar: the greedy pick obeys it, the logprobs are the raw logits' (vLLM's)
        assert allowed[6, tok[6]] and tok[6] == np.argmax(np.where(allowed[6], np.asarray(logits[6]), -np.inf))
        raw = np.asarray(jax.nn.log_softmax(logits[6]))
        np.testing.assert_allclose(lp[6], raw[tok[6]], rtol=1e-5)
        np.testing.assert_allclose(np.asarray(top_lp[6]), np.sort(raw)[::-1][:3], rtol=1e-5)


def test_params_validation():
    with pytest.raises(InvalidStructuredOutputsError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(InvalidStructuredOutputsError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(InvalidStructuredOutputsError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(InvalidStructuredOutputsError, match="json"):
        StructuredOutputsParams(json=5)
    with pytest.raises(InvalidSamplingParamsError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


# ---- the grammar compiler over SmolLM2's tokenizer (GGUF) ----------------------------------------
@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer):  # noqa: F811
    # the logits' vocabulary padded past the tokenizer's 49,152 ids, as a padded embedding would be
    return GrammarCompiler(smollm2_tokenizer, 49152 + 70, smollm2_tokenizer.eos_token_ids)


@pytest.mark.parametrize("bad", [
    StructuredOutputsParams(json={"type": "objectx"}),
    StructuredOutputsParams(json="{not json"),
    StructuredOutputsParams(regex="[0-9"),
    StructuredOutputsParams(grammar="start: foo"),
    StructuredOutputsParams(grammar="root ::= (\"a\""),
])
def test_invalid_constraints_are_named_errors(compiler, bad):
    with pytest.raises(InvalidStructuredOutputsError):
        compiler.compile(bad)


def test_masks_ban_padded_ids(compiler, smollm2_tokenizer):  # noqa: F811
    tok = smollm2_tokenizer
    assert compiler.width == packed_width(49152 + 70) == 1539
    g = compiler.compile(StructuredOutputsParams(choice=["yes", "no"]))
    m = compiler.matcher(g)
    mask = compiler.fill([(m, 1)], 3)
    assert mask.shape == (3, 1539) and np.all(mask[[0, 2]] == -1)
    allowed = np.nonzero(np.unpackbits(mask[1].view(np.uint8), bitorder="little"))[0]
    assert allowed.size and allowed.max() < 49152
    assert all(t.startswith(("y", "n")) or t in ("yes", "no") for t in (tok.decode([int(i)]) for i in allowed))


def test_fill_async_matches_fill(compiler, smollm2_tokenizer):  # noqa: F811
    """The helper thread's fill (what a deferred decode or mixed step uses) gives `fill`'s masks, rows in
    other states and the padded ids included, while the calling thread runs on meanwhile."""
    g = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    enc = functools.partial(smollm2_tokenizer.encode, add_special_tokens=False)
    texts = ["", '{"name": "Bo', '{"name": "Bob", "kind": "d', '{"name": "Al", "kind": "cat", "age": 1']
    ms = [compiler.matcher(g) for _ in texts]
    for m, t in zip(ms, texts):
        assert m.consume_tokens(enc(t))
    rows = [(m, r) for m, r in zip(ms, (5, 0, 3, 6))]
    want = compiler.fill(rows, 8)
    wait = compiler.fill_async(rows, 8)
    busy = sum(i * i for i in range(20000))  # this thread is free to run Python
    got = wait()
    assert busy and got.shape == want.shape == (8, compiler.width)
    np.testing.assert_array_equal(got, want)
    assert np.all(got[[1, 2, 4, 7]] == -1) and len({got[r].tobytes() for r in (5, 0, 3, 6)}) == 4


def test_gbnf_and_lark_grammars(compiler, smollm2_tokenizer):  # noqa: F811
    for grammar in ('root ::= "yes" | "no" | "maybe " [0-9]', 'start: "yes" | "no" | "maybe " /[0-9]/'):
        g = compiler.compile(StructuredOutputsParams(grammar=grammar))
        for text, ok in (("maybe 7", True), ("no", True), ("nope", False), ("maybe x", False)):
            m = compiler.matcher(g)
            ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
            assert (m.consume_tokens(ids) and m.is_accepting()) == ok, (grammar, text)


def test_disable_additional_properties(compiler, smollm2_tokenizer):  # noqa: F811
    """vLLM's `disable_additional_properties` (on by default, as vLLM's xgrammar backend): objects
    with `properties` and no `additionalProperties` take no other keys, at any depth; off, JSON
    Schema's default (any other key) holds. Data (`const`, `enum`) and a property named
    "properties" are not schemas and stay as they are; objects whose keys may come from elsewhere
    (`allOf` branches, `$ref` beside `properties`) stay open."""
    from metrale_jax.structured_output import _closed_objects

    schema = {"type": "object", "required": ["a"],
              "properties": {"a": {"type": "integer"},
                             "sub": {"anyOf": [{"type": "object", "properties": {"b": {"type": "integer"}}},
                                               {"type": "null"}]},
                             "properties": {"type": "object", "properties": {}, "additionalProperties": True},
                             "c": {"const": {"properties": {"x": 1}}}}}
    closed = _closed_objects(schema)
    assert closed["additionalProperties"] is False and "additionalProperties" not in schema  # a copy
    assert closed["properties"]["sub"]["anyOf"][0]["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is True
    assert closed["properties"]["c"] == {"const": {"properties": {"x": 1}}}
    assert set(closed["properties"]) == {"a", "sub", "properties", "c"}
    split = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                       {"type": "object", "properties": {"b": {"type": "integer"}}}]}
    assert _closed_objects(split) == split  # closing each branch would allow no object with both keys
    based = {"$ref": "#/$defs/B", "properties": {"c": {}}, "$defs": {"B": {"properties": {"b": {}}}}}
    assert "additionalProperties" not in _closed_objects(based)
    assert _closed_objects(based)["$defs"]["B"]["additionalProperties"] is False
    assert StructuredOutputsParams(json=schema).disable_additional_properties  # vLLM's default (xgrammar)
    cases = [('{"a": 1, "z": 2}', True, False), ('{"a": 1, "sub": {"b": 2}}', True, True),
             ('{"a": 1, "sub": {"b": 2, "y": 3}}', True, False), ('{"a": 1, "properties": {"q": 1}}', True, True)]
    for flag in (False, True):
        g = compiler.compile(StructuredOutputsParams(json=schema, disable_additional_properties=flag))
        for text, free, closed_ok in cases:
            m = compiler.matcher(g)
            ok = m.consume_tokens(smollm2_tokenizer.encode(text, add_special_tokens=False)) and m.is_accepting()
            assert ok == (closed_ok if flag else free), (flag, text)


def test_structural_tag(compiler, smollm2_tokenizer):  # noqa: F811
    """vLLM's structural tag: free text, in which a tool call starts at a trigger and must go on
    with one of the structures' `begin`, a JSON document of its schema and its `end`."""
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
            "additionalProperties": False}
    tag = {"type": "structural_tag", "triggers": ["<function="],
           "structures": [{"begin": "<function=get_weather>", "schema": city, "end": "</function>"},
                          {"begin": "<function=get_time>", "schema": {"type": "object"}, "end": "</function>"}]}
    cases = [("Just text, no call.", True),
             ('Let me check. <function=get_weather>{"city": "Paris"}</function> Done.', True),
             ('<function=get_time>{}</function><function=get_weather>{"city": "Oslo"}</function>', True),
             ('<function=get_weather>{"town": "Paris"}</function>', False),  # not the schema
             ('<function=get_news>{"topic": "x"}</function>', False),  # no such structure
             ('<function=get_weather>{"city": "Paris"}', False)]  # not ended yet
    for spec in (tag, json.dumps(tag)):
        g = compiler.compile(StructuredOutputsParams(structural_tag=spec))
        for text, ok in cases:
            m = compiler.matcher(g)
            got = m.consume_tokens(smollm2_tokenizer.encode(text, add_special_tokens=False)) and m.is_accepting()
            assert got == ok, text
    open_tag = {"triggers": ["<f="], "structures": [{"begin": "<f=x>", "end": "</f>",
                                                     "schema": {"type": "object", "properties": {"a": {}}}}]}
    for closed in (False, True):  # disable_additional_properties reaches the structures' schemas
        m = compiler.matcher(compiler.compile(StructuredOutputsParams(structural_tag=open_tag,
                                                                      disable_additional_properties=closed)))
        text = '<f=x>{"a": 1, "b": 2}</f>'
        ok = m.consume_tokens(smollm2_tokenizer.encode(text, add_special_tokens=False)) and m.is_accepting()
        assert ok != closed
    # a <...> trigger: this tokenizer's special token as that token, any other tag as text (SmolLM2 has
    # no <tool_call> token; llguidance would read it as one and fail)
    obj = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for trig in ("<tool_call>", "<|im_start|>"):
        t = {"triggers": [trig], "structures": [{"begin": trig, "schema": obj, "end": "</tool_call>"}]}
        g = compiler.compile(StructuredOutputsParams(structural_tag=t))
        for text, ok in ((f'Hi {trig}{{"a": 1}}</tool_call>', True), (f'Hi {trig}{{"b": 1}}</tool_call>', False)):
            m = compiler.matcher(g)
            ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
            assert (m.consume_tokens(ids) and m.is_accepting()) == ok, text
    for bad in ({"structures": [], "triggers": ["<f"]}, {"structures": tag["structures"], "triggers": ["<tool>"]},
                "{not json", {"structures": [{"begin": "<f=a>", "end": "</f>"}], "triggers": ["<f"]}):
        with pytest.raises(InvalidStructuredOutputsError, match="structural_tag"):
            compiler.compile(StructuredOutputsParams(structural_tag=bad))


def test_matchers_of_one_grammar_are_independent(compiler, smollm2_tokenizer):  # noqa: F811
    """One sequence's tokens, errors included, never show in another matcher's masks or state
    (matchers of one grammar may share caches)."""
    import llguidance

    g = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    enc = functools.partial(smollm2_tokenizer.encode, add_special_tokens=False)
    a = compiler.matcher(g)
    assert a.consume_tokens(enc('{"name": "Bo')) and not a.is_error()
    bad = compiler.matcher(g)
    assert not bad.consume_tokens(enc("[1, 2]")) and bad.is_error()
    b = compiler.matcher(g)
    ref = llguidance.LLMatcher(compiler.llg_tokenizer, g, log_level=0)  # not a copy
    assert not b.is_error()
    np.testing.assert_array_equal(compiler.fill([(b, 0)], 1), compiler.fill([(ref, 0)], 1))
    assert not np.array_equal(compiler.fill([(a, 0)], 1), compiler.fill([(b, 0)], 1))
    doc = enc('{"name": "Bo')
    assert b.consume_tokens(doc) and ref.consume_tokens(doc)
    np.testing.assert_array_equal(compiler.fill([(a, 0)], 1), compiler.fill([(b, 0)], 1))


def test_server_protocol_mapping():
    from metrale_jax.server.protocol import ChatCompletionRequest, CompletionRequest, RequestError, parse_request

    def so(model, body):
        return parse_request(model, json.dumps(body).encode()).to_sampling_params_kwargs(256)["structured_outputs"]

    msgs = [{"role": "user", "content": "x"}]
    assert so(ChatCompletionRequest, {"messages": msgs}) is None
    assert so(ChatCompletionRequest, {"messages": msgs, "response_format": {"type": "text"}}) is None
    assert so(ChatCompletionRequest, {"messages": msgs, "response_format": {"type": "json_object"}}).json_object
    got = so(ChatCompletionRequest, {"messages": msgs, "response_format": {
        "type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}})
    assert got.json == SCHEMA
    assert so(CompletionRequest, {"prompt": "x", "guided_json": json.dumps(SCHEMA)}).json == json.dumps(SCHEMA)
    assert so(CompletionRequest, {"prompt": "x", "guided_regex": "a+"}).regex == "a+"
    assert so(CompletionRequest, {"prompt": "x", "guided_choice": ["a", "b"]}).choice == ["a", "b"]
    assert so(CompletionRequest, {"prompt": "x", "guided_grammar": "start: /a/"}).grammar == "start: /a/"
    got = so(CompletionRequest, {"prompt": "x", "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
    assert got.json == SCHEMA and got.disable_any_whitespace and got.disable_additional_properties  # the default
    got = so(CompletionRequest, {"prompt": "x", "structured_outputs": {"json": SCHEMA,
                                                                        "disable_additional_properties": False}})
    assert not got.disable_additional_properties
    tag = {"type": "structural_tag", "triggers": ["<f="],
           "structures": [{"begin": "<f=a>", "schema": {}, "end": "</f>"}]}
    got = so(ChatCompletionRequest, {"messages": msgs, "structured_outputs": {"structural_tag": tag}})
    assert got.structural_tag == tag
    got = so(ChatCompletionRequest, {"messages": msgs, "response_format": tag})  # vLLM's response_format form
    assert got.structural_tag == tag
    with pytest.raises(RequestError) as e:
        so(CompletionRequest, {"prompt": "x", "structured_outputs": {"regex": "a"}, "guided_regex": "b"})
    assert e.value.param == "guided_regex" and e.value.status == 400


# ---- SmolLM2 through LLM.generate and the server --------------------------------------------------
@pytest.fixture(scope="module")
def llm(smollm2_gguf):  # noqa: F811
    from metrale_jax.engine import EngineConfig, LLMEngine
    from metrale_jax.llm import LLM
    from metrale_jax.model import load_model

    model, params = load_model(smollm2_gguf, dtype="float32", show_progress=False)
    cfg = EngineConfig(dtype="float32", max_model_len=256, block_size=16, num_kv_blocks=144, max_num_seqs=8,
                       max_num_batched_tokens=64, decode_buckets=(8,), mixed_decode_buckets=(8,),
                       prefill_buckets=(64,), max_prefill_streams=4, max_logprobs=2, show_progress=False,
                       attention=fast_cpu_steps())
    return LLM.from_engine(LLMEngine(model, params, cfg))


PET = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
       "required": ["name", "age"], "additionalProperties": False}
ANIMALS = ["a cat", "a dog", "a parrot", "an old cat", "a puppy", "a canary", "a sleepy dog", "a kitten"]


def _chat_prompt(llm, text: str) -> dict:
    ids = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True)
    return {"prompt_token_ids": ids}


def test_json_schema_outputs_validate(llm):
    """A nested schema through generate, without free whitespace (`disable_any_whitespace`: about
    half the tokens of SmolLM2's indented JSON, which the server tests below get)."""
    from metrale_jax.engine.compile import CompileCounter

    prompts = [_chat_prompt(llm, f"Describe {a} as a JSON object.") for a in ANIMALS]
    sp = SamplingParams(temperature=0.8, seed=11, max_tokens=160,
                        structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    with CompileCounter() as cc:
        outs = llm.generate(prompts, sp, use_tqdm=False)
    assert cc.lowerings == 0  # a constrained request compiles nothing
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text  # the grammar ended with EOS
        jsonschema.validate(json.loads(c.text), SCHEMA)
        assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', "", c.text)), c.text  # none outside strings
    assert len({o.outputs[0].text for o in outs}) > 1


def test_regex_and_choice_with_free_rows(llm, monkeypatch):
    """A regex request with n=2, a choice request with n=3 and an unconstrained one in the same
    batches; the unconstrained one must come out as it does alone, and steps without a constrained
    row send no mask."""
    eng = llm.llm_engine
    masks = []  # the bitmask each step ran with (None: the compiler's constant, nothing sent)
    run = eng.compiler.run
    monkeypatch.setattr(eng.compiler, "run", lambda *a: (masks.append(a[5]), run(*a))[1])
    # (penalties: the deferred sample of a constrained step reads the penalty state its forward left)
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3,
                          frequency_penalty=0.5)
    p_free = _chat_prompt(llm, "Tell me about the sea.")
    alone = llm.generate([p_free], free, use_tqdm=False)[0].outputs[0].token_ids
    assert masks and all(m is None for m in masks)
    masks.clear()
    regex = r"[A-Z][a-z]{2,8} [0-9]{2}"
    sps = [SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=24,
                          structured_outputs=StructuredOutputsParams(regex=regex)),
           SamplingParams(temperature=1.0, seed=6, n=3, max_tokens=24,
                          structured_outputs=StructuredOutputsParams(choice=["red", "green", "dark blue"])),
           free]
    prompts = [_chat_prompt(llm, "Name a person and an age."), _chat_prompt(llm, "Pick a colour."), p_free]
    outs = llm.generate(prompts, sps, use_tqdm=False)
    assert any(m is not None for m in masks) and masks[-1] is None  # the free row ends alone
    for c in outs[0].outputs:
        assert c.finish_reason == "stop" and re.fullmatch(regex, c.text), c.text
    assert all(c.finish_reason == "stop" and c.text in ("red", "green", "dark blue") for c in outs[1].outputs)
    assert outs[2].outputs[0].token_ids == alone
    # a bad constraint is rejected before anything is queued
    with pytest.raises(InvalidStructuredOutputsError):
        llm.generate(prompts, [sps[0], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")), free],
                     use_tqdm=False)
    assert not eng.has_unfinished_requests() and eng.stats().kv_blocks_used == 0


def test_grammar_and_allowed_token_ids_together(llm):
    """A choice constraint ANDed with allowed_token_ids (the fixed mask over the grammar's, filled
    on the mask thread): only "dark blue" can be spelled with the allowed tokens; a free row beside."""
    eng = llm.llm_engine
    tok = llm.get_tokenizer()
    allowed = tok.encode("dark blue", add_special_tokens=False) + list(eng.eos_token_ids)
    sps = [SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=12, allowed_token_ids=allowed,
                          structured_outputs=StructuredOutputsParams(choice=["red", "green", "dark blue"])),
           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)]
    outs = llm.generate([_chat_prompt(llm, "Pick a colour."), _chat_prompt(llm, "Hi.")], sps, use_tqdm=False)
    assert [c.text for c in outs[0].outputs] == ["dark blue"] * 3
    assert len(outs[1].outputs[0].token_ids) == 6
    assert not eng.has_unfinished_requests() and eng.stats().kv_blocks_used == 0


def test_structural_tag_through_generate(llm):
    """A structural tag through `LLM.chat`: free text, and every ```json code block the model opens
    holds an object of the schema and is closed (SmolLM2 opens one when asked to)."""
    tag = {"type": "structural_tag", "triggers": ["```"],
           "structures": [{"begin": "```json\n", "schema": PET, "end": "\n```"}]}
    sp = SamplingParams(temperature=0.8, seed=3, max_tokens=80,
                        structured_outputs=StructuredOutputsParams(structural_tag=tag))
    outs = llm.chat([[{"role": "user", "content": f"Describe {a} as JSON (name, age) in a ```json code block."}]
                     for a in ANIMALS[:4]], sp)
    blocks = 0
    for o in outs:
        text = o.outputs[0].text
        found = re.findall(r"```json\n(.*?)\n```", text, re.S)
        for b in found:
            jsonschema.validate(json.loads(b), PET)
        blocks += len(found)
        assert text.count("```") % 2 == 0 or o.outputs[0].finish_reason == "length", text
    assert blocks >= 2  # (the tag was exercised, not only free text)


def test_server_response_format(llm):
    openai = pytest.importorskip("openai")
    from metrale_jax.server import BackgroundServer, ServerConfig

    with BackgroundServer(llm.llm_engine, ServerConfig(model_names=("smol",))) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=300)
        msgs = [{"role": "user", "content": "Describe a cat as JSON."}]
        r = client.chat.completions.create(
            model="smol", messages=msgs, max_tokens=80, temperature=0.8, seed=3,
            response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}})
        for ch in r.choices:
            assert ch.finish_reason == "stop"
            jsonschema.validate(json.loads(ch.message.content), PET)
        r = client.chat.completions.create(model="smol", messages=msgs, max_tokens=8, temperature=1.0,
                                           extra_body={"guided_choice": ["meow", "purr"]})
        assert r.choices[0].message.content in ("meow", "purr")
        r = client.completions.create(model="smol", prompt="The year is", max_tokens=8,
                                      extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
        assert re.fullmatch("[0-9]{4}", r.choices[0].text)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="smol", messages=msgs, max_tokens=8, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}})
        assert e.value.body["code"] == "invalid_structured_outputs"


def test_server_tool_calls(llm):
    """Forced tool calls through the server with the openai client: SmolLM2's replies are
    constrained to the named tool's parameters, or to one call of the given tools."""
    openai = pytest.importorskip("openai")
    from metrale_jax.server import BackgroundServer, ServerConfig

    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"], "additionalProperties": False}
    tz = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET", "PST"]}}, "required": ["tz"],
          "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "forecast", "parameters": city}},
             {"type": "function", "function": {"name": "clock", "parameters": tz}}]
    msgs = [{"role": "user", "content": "What will the weather be in Paris this week, and what time is it?"}]
    with BackgroundServer(llm.llm_engine, ServerConfig(model_names=("smol",))) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=300)
        r = client.chat.completions.create(model="smol", messages=msgs, tools=tools, max_tokens=80, temperature=0.7,
                                           seed=1, n=2, tool_choice={"type": "function", "function": {"name": "clock"}})
        for ch in r.choices:
            (call,) = ch.message.tool_calls
            assert ch.finish_reason == "stop" and call.function.name == "clock"
            jsonschema.validate(json.loads(call.function.arguments), tz)
        stream = client.chat.completions.create(model="smol", messages=msgs, tools=tools, max_tokens=120,
                                                temperature=0.7, seed=2, tool_choice="required", stream=True,
                                                parallel_tool_calls=False)
        calls: dict[int, list[str]] = {}
        for chunk in stream:
            for tc in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
                calls.setdefault(tc.index, ["", ""])
                calls[tc.index][0] += tc.function.name or ""
                calls[tc.index][1] += tc.function.arguments or ""
            finish = chunk.choices[0].finish_reason if chunk.choices else None
        assert finish == "tool_calls" and len(calls) == 1  # (parallel_tool_calls false: one call)
        for name, args in calls.values():
            jsonschema.validate(json.loads(args), {"forecast": city, "clock": tz}[name])
        with pytest.raises(openai.BadRequestError, match="tool-call-parser"):
            client.chat.completions.create(model="smol", messages=msgs, tools=tools, max_tokens=8)


def test_constrained_decode_steps_dispatch_the_forward_first(llm, monkeypatch):
    """Decode and mixed buckets are forward + sample executables (equal to the one-executable step
    bit for bit: tests/test_split_step.py); a decode step with constrained rows dispatches its forward
    before the previous step's samples are awaited and fed to the grammars and the masks filled (on
    the mask thread), and its sample is launched only once the next step's inputs are sent (before
    that step's forward). The outputs follow their constraints and a second run gives the same tokens."""
    eng = llm.llm_engine
    comp = eng.compiler
    decode = [b for b in comp.buckets if b.kind == "decode"]
    mixed = [b for b in comp.buckets if b.kind == "mixed"]
    assert decode and mixed and all(comp.has_split(b) and b not in comp.executables for b in decode + mixed)
    assert not any(comp.has_split(b) for b in comp.buckets if b.kind == "prefill")
    events = []
    run_forward, run_sample, put, feed = comp.run_forward, comp.run_sample, comp.put, eng._feed_grammars
    monkeypatch.setattr(comp, "run_forward", lambda *a: (events.append(f"forward:{a[0].kind}"), run_forward(*a))[1])
    monkeypatch.setattr(comp, "run_sample", lambda *a: (events.append("sample"), run_sample(*a))[1])
    monkeypatch.setattr(comp, "put", lambda *a: (events.append("put" if len(a) == 2 else "mask"), put(*a))[1])
    monkeypatch.setattr(eng, "_feed_grammars", lambda f: (
        events.append("feed" if threading.current_thread() is not threading.main_thread() else "feed:main"),
        feed(f))[1])
    sps = [SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=20,
                          structured_outputs=StructuredOutputsParams(regex=r"[A-Z][a-z]{2,8} [0-9]{2}")),
           SamplingParams(temperature=0, max_tokens=12, logprobs=2,
                          structured_outputs=StructuredOutputsParams(choice=["red", "green", "dark blue"])),
           SamplingParams(temperature=0.7, seed=3, max_tokens=10, ignore_eos=True)]
    # (the free prompt: long and this test's own, so its chunks run in mixed steps beside the
    # constrained rows' decoding, even when the prefix cache holds the other two)
    long_free = ("Tell me about the sea near the harbour town where my grandmother grew up, with its "
                 "grey tides, its winter storms, the fishing boats, the lighthouse keeper's dog and the "
                 "old market by the water, in a long and careful answer.")
    prompts = [_chat_prompt(llm, "Name a person and an age."), _chat_prompt(llm, "Pick a colour."),
               _chat_prompt(llm, long_free)]
    assert len(prompts[2]["prompt_token_ids"]) > 64  # (the fixture's max_num_batched_tokens)
    first = llm.generate(prompts, sps, use_tqdm=False)
    joined = " ".join(events)
    # forward, then on the mask thread the previous step's samples fed to the grammars and the
    # masks filled, while this thread sends the next step's inputs; then this step's masks, its
    # sample, the next forward
    assert re.search(r"forward:\w+ (feed put|put feed) mask sample forward", joined), joined
    # both kinds of split step ran with constrained rows (mixed: decoding beside the long prompt's
    # chunk) and fed the previous samples on the mask thread (the last step's are fed on this one)
    assert re.search("forward:decode (put )?feed(?!:)", joined) and re.search("forward:mixed (put )?feed(?!:)", joined)
    for c in first[0].outputs:
        assert re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{2}", c.text), c.text
    assert first[1].outputs[0].text in ("red", "green", "dark blue")
    again = llm.generate(prompts, sps, use_tqdm=False)
    for w, g in zip(first, again):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        assert [c.cumulative_logprob for c in g.outputs] == [c.cumulative_logprob for c in w.outputs]


def test_draft_window_masks(compiler, smollm2_tokenizer):  # noqa: F811
    """A verify window's masks: row r + j is the grammar's mask after drafts d1..dj (each checked
    against a matcher that consumed them one by one), drafts past the first the grammar forbids
    are cut, and the matcher is left as it was."""
    tok = smollm2_tokenizer
    m = compiler.matcher(compiler.compile(StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,5}")))
    ids = list(tok.encode("123-abc", add_special_tokens=False))
    assert len(ids) >= 3
    bad = tok.encode("!", add_special_tokens=False)[0]
    assert compiler.valid_drafts(m, ids + [bad, ids[0]]) == ids and compiler.valid_drafts(m, [bad]) == []
    got = compiler.fill([(m, 2, ids)], 2 + len(ids) + 2)
    ref = compiler.matcher(compiler.compile(StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,5}")))
    for j in range(len(ids) + 1):
        np.testing.assert_array_equal(got[2 + j], compiler.fill([(ref, 0)], 1)[0], err_msg=f"position {j}")
        if j < len(ids):
            assert ref.consume_token(ids[j])
    assert (got[:2] == -1).all() and (got[2 + len(ids) + 1:] == -1).all()
    np.testing.assert_array_equal(compiler.fill([(m, 0)], 1)[0], got[2])  # m unchanged


def test_forced_drafts_jump_forward(compiler, smollm2_tokenizer):  # noqa: F811
    """A constrained row's verify drafts: the tokens its grammar forces come first (a JSON key after
    its opening quote), the proposed drafts are kept where they continue them, and never more than
    k or anything the grammar rejects; the matcher is left as it was."""
    tok = smollm2_tokenizer
    schema = {"type": "object", "properties": {"identifier_of_the_animal": {"type": "integer"}},
              "required": ["identifier_of_the_animal"], "additionalProperties": False}
    m = compiler.matcher(compiler.compile(StructuredOutputsParams(json=schema)))
    head = tok.encode('{"', add_special_tokens=False)
    assert all(m.consume_token(t) for t in head)
    forced = list(m.compute_ff_tokens())
    assert tok.decode(forced).startswith("identifier_of_the_animal") and len(forced) >= 4
    assert compiler.forced_drafts(m, [], 3) == forced[:3]  # no proposal: the forced tokens
    bad = tok.encode("!", add_special_tokens=False)[0]
    assert compiler.forced_drafts(m, [bad, bad], 8) == forced[:8]  # a proposal that disagrees gives way
    longer = forced + tok.encode(": 7", add_special_tokens=False)
    assert compiler.forced_drafts(m, longer, 64) == compiler.valid_drafts(m, longer)  # continues them
    assert compiler.forced_drafts(m, longer, 0) == []
    assert list(m.compute_ff_tokens()) == forced  # unchanged
    free = compiler.matcher(compiler.compile(StructuredOutputsParams(regex=r"[a-z]+")))
    assert compiler.forced_drafts(free, [bad], 3) == []  # nothing forced: the accepted prefix


@pytest.mark.slow  # (~60 s on 2 cores: a second SmolLM2 engine; CI time)
def test_speculative_decoding_with_grammars(llm, smollm2_gguf):  # noqa: F811
    """n-gram speculation over constrained rows: greedy outputs equal the unspeculated engine's
    (the grammar masks every window position; a draft it forbids is rejected), drafts were
    verified and accepted, and sampled rows still follow their constraints."""
    from metrale_jax.engine import LLMEngine
    from metrale_jax.llm import LLM
    from metrale_jax.model import load_model

    model, params = load_model(smollm2_gguf, dtype="float32", show_progress=False)
    cfg = llm.llm_engine.config.replace(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    spec = LLM.from_engine(LLMEngine(model, params, cfg))
    regex = r"(cat|dog)( (cat|dog|bird)){6,12}\."
    sps = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=regex)),
           SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
           SamplingParams(temperature=0, max_tokens=24),
           SamplingParams(temperature=1.0, seed=4, n=2, max_tokens=40,
                          structured_outputs=StructuredOutputsParams(regex=regex))]
    prompts = [_chat_prompt(llm, "List some animals, cat dog cat dog cat dog."),
               _chat_prompt(llm, "Describe a cat as a JSON object."),
               _chat_prompt(llm, "Say cat dog cat dog cat dog cat dog."),
               _chat_prompt(llm, "List some animals.")]
    want = llm.generate(prompts[:3], sps[:3], use_tqdm=False)
    got = spec.generate(prompts, sps, use_tqdm=False)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids, (w.outputs[0].text, g.outputs[0].text)
    assert re.fullmatch(regex, got[0].outputs[0].text)
    if got[1].outputs[0].finish_reason == "stop":  # (else cut by max_tokens)
        jsonschema.validate(json.loads(got[1].outputs[0].text), SCHEMA)
    assert all(c.finish_reason == "stop" and re.fullmatch(regex, c.text) for c in got[3].outputs)
    st = spec.stats()
    assert st.spec_draft_tokens > 0 and st.spec_accepted_tokens > 0
    # jump-forward: a schema of long keys, which no prompt holds, so n-gram lookup drafts little;
    # the forced keys are drafted and accepted, and the output equals the unspeculated engine's
    keys = {"identifier_of_the_animal": {"type": "integer"}, "favourite_food_of_the_animal": {"enum": ["fish", "meat"]}}
    schema = {"type": "object", "properties": keys, "required": list(keys), "additionalProperties": False}
    sp = SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema))
    prompt = _chat_prompt(llm, "Describe a cat.")
    want = llm.generate([prompt], [sp], use_tqdm=False)[0].outputs[0]
    before = spec.stats().spec_accepted_tokens
    got = spec.generate([prompt], [sp], use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and json.loads(got.text).keys() == keys.keys()
    assert spec.stats().spec_accepted_tokens - before >= 10, spec.stats()


def test_grammar_rejecting_a_token_finishes_only_its_row(llm):
    """min_tokens past a finished grammar bans the only token it allows (EOS): the row samples a
    token its grammar rejects and finishes with "abort"; the rows beside it are unaffected."""
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    p_free = _chat_prompt(llm, "Tell me about the sea.")
    alone = llm.generate([p_free], free, use_tqdm=False)[0].outputs[0].token_ids
    stuck = SamplingParams(temperature=0, max_tokens=12, min_tokens=8,
                           structured_outputs=StructuredOutputsParams(choice=["red", "blue"]))
    ok = SamplingParams(temperature=0, max_tokens=12,
                        structured_outputs=StructuredOutputsParams(choice=["red", "blue"]))
    prompts = [_chat_prompt(llm, "Pick a colour."), p_free, _chat_prompt(llm, "Pick a colour.")]
    outs = llm.generate(prompts, [stuck, free, ok], use_tqdm=False)
    stuck_out = outs[0].outputs[0]
    assert stuck_out.finish_reason == "abort" and stuck_out.text in ("red", "blue")
    # the rejected token is not part of the output
    assert llm.get_tokenizer().decode(stuck_out.token_ids) == stuck_out.text
    assert outs[1].outputs[0].token_ids == alone
    assert outs[2].outputs[0].finish_reason == "stop" and outs[2].outputs[0].text in ("red", "blue")


def test_abort_while_the_masks_fill(llm):
    """Requests aborted between steps, while the next step's masks are being filled on the helper
    thread (their matchers among the rows), end with "abort"; the other constrained rows finish
    their grammars and the engine drains."""
    eng = llm.llm_engine
    regex = r"[A-Z][a-z]{2,8} [0-9]{2}"
    sp = SamplingParams(temperature=1.0, seed=9, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=regex))
    for i in range(4):
        eng.add_request(f"fill-abort-{i}", _chat_prompt(llm, f"Name person number {i} and an age."), sp)
    done, aborted = {}, False
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        pending = eng._inflight is not None and eng._inflight.launch is not None  # a fill in flight
        if pending and not aborted and all(s.num_outputs for r in ("fill-abort-0", "fill-abort-2")
                                           for s in eng.requests[r].seqs):
            eng.abort("fill-abort-0")
            eng.abort("fill-abort-2")
            aborted = True
    assert aborted and "fill-abort-0" not in done and "fill-abort-2" not in done
    for i in (1, 3):
        c = done[f"fill-abort-{i}"].outputs[0]
        assert c.finish_reason == "stop" and re.fullmatch(regex, c.text), c.text
