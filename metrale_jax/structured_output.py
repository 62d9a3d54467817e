"""Structured output: JSON schema, regex, choice and grammar constraints (vLLM's API, llguidance).

    SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))   # or regex= / choice= /
                                                                             # grammar= / json_object=True

The constraint is compiled by llguidance (guidance-ai's Rust library; chosen over xgrammar after
`bench/grammar_libs.py`, see the README) against the model's own tokenizer, the `tokenizers` JSON
of a Hugging Face folder or of a GGUF file alike. Each constrained sequence owns an `LLMatcher`;
before a step samples it, the host fills the row's packed bitmask (bit j of word w allows token
32*w + j), and the step bans every other token on the device (`sampling.apply_token_bitmask`,
ahead of every sampling rule). Ids at or past the tokenizer's vocabulary (a padded embedding) are
always banned for a constrained row. A row whose grammar is complete may only sample EOS.

The mask of a row depends on the token it sampled last. The engine dispatches step i+1 before it
has read step i's samples; decode and mixed steps are two executables (the forward to the logits,
then the sampler), so for a constrained step `LLMEngine._dispatch` launches the forward and hands
a helper thread the rest (`GrammarCompiler.fill_async`): wait for step i's sampled ids, feed them
to the grammars (`LLMEngine._feed_grammars`), fill the masks (llguidance consumes and fills with
the GIL released); the sampler is launched by the next step once its inputs are sent, after
waiting for the masks: the fill, reading step i and building step i+2 all run while the forward
does, and the engine's thread reads step i's samples only once, when it applies them. The mask has
one row per sampled row of the step (S; with speculative decoding S x (1 + k): a verify step's
window position j is masked by the grammar's state after the row's drafts d1..dj, which llguidance's
`fill_next_token_bitmask_par_with_draft_tokens` fills, so a draft the grammar forbids is never
sampled there and is rejected; drafts past the first the grammar forbids are not sent at all).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from metrale_jax.errors import InvalidStructuredOutputsError

log = logging.getLogger(__name__)

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """vLLM's `StructuredOutputsParams`: exactly one of `json` (a JSON schema, dict or string),
    `regex`, `choice` (a list of strings), `grammar` (Lark, or llama.cpp's GBNF),
    `json_object=True` (any JSON object) or `structural_tag` (free text in which each tool call
    follows its schema: vLLM's {"type": "structural_tag", "structures": [{"begin", "schema",
    "end"}, ...], "triggers": [...]}, a dict or its JSON; a call starts where the text reaches a
    trigger, and must go on with one of the `begin` strings that start with it, a JSON document
    of that structure's schema and its `end`).

    disable_any_whitespace: JSON without free whitespace between tokens (compact `,` and `:`);
    by default any JSON whitespace is allowed, as vLLM. whitespace_pattern: a regex for the
    whitespace between JSON tokens instead. disable_additional_properties (default True): a
    schema's objects that list `properties` and say nothing of `additionalProperties` take no other
    keys, as with vLLM's default backend (xgrammar's strict mode) and outlines; False gives JSON
    Schema's own default, which llguidance (vLLM's "guidance" backend) follows: any other key.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    disable_additional_properties: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise InvalidStructuredOutputsError unless exactly one constraint is set, of the right type."""
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidStructuredOutputsError(
                f"structured_outputs needs exactly one of {', '.join(_KINDS)}; got "
                f"{', '.join(given) if given else 'none'}")
        if self.json is not None and not isinstance(self.json, str | dict):
            raise InvalidStructuredOutputsError(f"json must be a JSON schema (dict or string), got "
                                                f"{type(self.json).__name__}")
        if self.regex is not None and not isinstance(self.regex, str):
            raise InvalidStructuredOutputsError(f"regex must be a string, got {type(self.regex).__name__}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise InvalidStructuredOutputsError(f"grammar must be a string, got {type(self.grammar).__name__}")
        if self.choice is not None and (not isinstance(self.choice, list | tuple) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidStructuredOutputsError("choice must be a non-empty list of non-empty strings")
        if self.json_object not in (None, True, False):
            raise InvalidStructuredOutputsError("json_object must be true or absent")
        if self.structural_tag is not None and not isinstance(self.structural_tag, str | dict):
            raise InvalidStructuredOutputsError(f"structural_tag must be a dict or its JSON, got "
                                                f"{type(self.structural_tag).__name__}")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise InvalidStructuredOutputsError("whitespace_pattern must be a string")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """A string that identifies the compiled grammar (the compile cache's key)."""
        v = getattr(self, self.kind)
        body = json.dumps(v, sort_keys=True) if not isinstance(v, str) else v
        return (f"{self.kind}|{self.disable_any_whitespace}|{self.whitespace_pattern}|"
                f"{self.disable_additional_properties}|{body}")


def _llguidance():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401
    except ImportError as e:  # a core dependency; absent only in a broken install
        raise InvalidStructuredOutputsError(f"structured output needs the llguidance package: {e}") from e
    return llguidance


def grammar_text(p: StructuredOutputsParams, tag_triggers_special: bool = True) -> str:
    """The llguidance grammar of `p` (not checked yet: `GrammarCompiler.compile` does).
    tag_triggers_special: a structural tag's triggers written <...> are special tokens (vLLM's
    reading, llguidance's default), else text."""
    llg = _llguidance()
    M = llg.LLMatcher
    kind = p.kind
    try:
        if kind in ("json", "json_object"):
            if kind == "json_object":
                schema: Any = {"type": "object"}
            elif isinstance(p.json, str):
                try:
                    schema = json.loads(p.json)
                except ValueError as e:
                    raise InvalidStructuredOutputsError(f"json: the schema is not valid JSON: {e}") from None
            else:
                schema = p.json
            if not isinstance(schema, dict):
                raise InvalidStructuredOutputsError("json: a JSON schema must be a JSON object")
            if p.disable_additional_properties:
                schema = _closed_objects(schema)
            opts: dict[str, Any] = {}
            if p.disable_any_whitespace:
                opts["whitespace_flexible"] = False
            if p.whitespace_pattern is not None:
                opts["whitespace_pattern"] = p.whitespace_pattern
            return M.grammar_from_json_schema(schema, defaults=opts or None)
        if kind == "structural_tag":
            return _structural_tag_grammar(llg, p.structural_tag, p.disable_additional_properties,
                                           tag_triggers_special)
        if kind == "regex":
            return M.grammar_from_regex(p.regex)
        if kind == "choice":
            # Lark string literals are JSON strings
            return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in p.choice))
        return llg.grammar_from("grammar", p.grammar)  # Lark, or GBNF converted to Lark
    except InvalidStructuredOutputsError:
        raise
    except (ValueError, TypeError) as e:
        raise InvalidStructuredOutputsError(f"{kind}: {e}") from None


def _structural_tag_grammar(llg, spec: str | dict, closed: bool, special: bool = True) -> str:
    """llguidance's grammar of a vLLM structural tag (`StructuredOutputsParams.structural_tag`):
    each structure a `llguidance.StructTag` under the first trigger its `begin` starts with
    (`closed`: its schema's objects take no other keys, `_closed_objects`)."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError as e:
            raise InvalidStructuredOutputsError(f"structural_tag: not valid JSON: {e}") from None
    structures = spec.get("structures") if isinstance(spec, dict) else None
    triggers = spec.get("triggers") if isinstance(spec, dict) else None
    if not (isinstance(structures, list) and structures and isinstance(triggers, list) and triggers
            and all(isinstance(t, str) and t for t in triggers)):
        raise InvalidStructuredOutputsError('structural_tag needs {"structures": [{"begin", "schema", "end"}, ...], '
                                            '"triggers": [non-empty strings]}')
    tags = []
    for i, st in enumerate(structures):
        if not (isinstance(st, dict) and isinstance(st.get("begin"), str) and isinstance(st.get("end"), str)
                and isinstance(st.get("schema"), dict)):
            raise InvalidStructuredOutputsError(f"structural_tag: structures[{i}] needs string begin and end and a "
                                                "JSON schema (an object) as schema")
        trigger = next((t for t in triggers if st["begin"].startswith(t)), None)
        if trigger is None:
            raise InvalidStructuredOutputsError(f"structural_tag: structures[{i}] begin {st['begin']!r} starts "
                                                f"with none of the triggers {triggers}")
        schema = _closed_objects(st["schema"]) if closed else st["schema"]
        tags.append(llg.StructTag(trigger=trigger, begin=st["begin"], grammar=schema, end=st["end"]))
    try:
        return llg.StructTag.to_grammar(tags, assume_special=special)
    except AssertionError as e:  # (llguidance checks its tags with asserts)
        raise InvalidStructuredOutputsError(f"structural_tag: {e}") from None


# the subschemas closed in turn: where an object schema describes a whole value (not `allOf`'s
# branches, which each describe part of one, nor `not` / `if`, whose meaning closing would change)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> schema
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "additionalItems", "then", "else", "contains")
# an object schema with these beside `properties` takes keys from elsewhere: left open
_OPEN_BESIDE = ("additionalProperties", "unevaluatedProperties", "allOf", "$ref", "dependentSchemas", "if")


def _closed_objects(schema: Any) -> Any:
    """A copy of a JSON schema in which every object schema with `properties` and no
    `additionalProperties` gets `additionalProperties: false`, at any depth of its subschemas
    (properties, items, anyOf / oneOf branches, $defs, ...; not inside `enum` / `const` values,
    which are data). Where keys may come from elsewhere (`allOf` branches, a `$ref` or `if` beside
    `properties`) the object stays open: permissive rather than unsatisfiable."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {name: _closed_objects(s) for name, s in schema[key].items()}
    for key in _SCHEMA_LISTS + _SCHEMA_ONE:
        v = schema.get(key)
        if isinstance(v, list):
            out[key] = [_closed_objects(s) for s in v]
        elif isinstance(v, dict):
            out[key] = _closed_objects(v)
    if isinstance(schema.get("properties"), dict) and not any(k in schema for k in _OPEN_BESIDE):
        out["additionalProperties"] = False
    return out


def packed_width(vocab_size: int) -> int:
    """Words of a packed token bitmask row: ceil(vocab_size / 32)."""
    return -(-int(vocab_size) // 32)


class GrammarCompiler:
    """llguidance over one model's tokenizer: compiles constraints, makes matchers, fills masks.

    vocab_size: the model's (logits') vocabulary, which may exceed the tokenizer's (padding);
    masks are int32[rows, ceil(vocab_size / 32)].
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...], *, cache_size: int = 256):
        llg = _llguidance()
        backend = getattr(tokenizer, "backend", tokenizer)  # metrale's Tokenizer or a tokenizers.Tokenizer
        if not hasattr(backend, "to_str"):
            raise InvalidStructuredOutputsError(
                f"structured output needs a `tokenizers` tokenizer; this model's is a {type(tokenizer).__name__}")
        n_tok = backend.get_vocab_size(with_added_tokens=True)
        self.vocab_size = int(vocab_size)
        self.tokenizer_vocab = n_tok
        self.llg_tokenizer = llg.LLTokenizer(backend.to_str(), n_vocab=max(n_tok, self.vocab_size),
                                             eos_token=list(eos_token_ids) or None)
        self.width = packed_width(self.vocab_size)
        self._llg_width = packed_width(self.llg_tokenizer.vocab_size)
        # bits of the ids a constrained row may ever sample: those of the tokenizer, within the logits
        valid = np.zeros(self.width * 32, np.uint8)
        valid[: min(n_tok, self.vocab_size)] = 1
        self.valid_row = np.packbits(valid, bitorder="little").view(np.int32)  # i32[W]
        self._valid_from = min(n_tok, self.vocab_size) // 32  # the first word of valid_row not all ones
        self._executor = llg.LLExecutor()
        self._pool: ThreadPoolExecutor | None = None  # fill_async's helper thread (made on first use)
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._cache_size = cache_size

    def compile(self, p: StructuredOutputsParams) -> str:
        """The checked grammar of `p` (cached); InvalidStructuredOutputsError if it is invalid."""
        key = p.key()
        g = self._cache.get(key)
        if g is not None:
            self._cache.move_to_end(key)
            return g
        try:
            g = grammar_text(p)
            err = _llguidance().LLMatcher.validate_grammar(g, self.llg_tokenizer)
            if err and p.kind == "structural_tag" and "unknown special token" in err:
                # a <...> trigger that is no special token of this tokenizer (e.g. an ordinary
                # added token): matched as text instead
                g = grammar_text(p, tag_triggers_special=False)
                err = _llguidance().LLMatcher.validate_grammar(g, self.llg_tokenizer)
        except InvalidStructuredOutputsError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever the library raises on a bad constraint is the caller's
            raise InvalidStructuredOutputsError(f"invalid {p.kind} constraint: {type(e).__name__}: {e}") from None
        if err:
            raise InvalidStructuredOutputsError(f"invalid {p.kind} constraint: {err.strip()}")
        self._cache[key] = g
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return g

    def matcher(self, grammar: str):
        """A fresh `LLMatcher` for one sequence. (Not copies of one template per grammar: those
        share its lexer's state cache, 6x faster masks in revisited states on the dev box's
        one thread, but the batch fill's threads then contend for it: +115% per batch-64 step
        on the H200 against +12-33% with fresh matchers, session 24.)"""
        m = _llguidance().LLMatcher(self.llg_tokenizer, grammar, log_level=0)
        if m.is_error():
            raise InvalidStructuredOutputsError(f"grammar rejected: {m.get_error()}")
        return m

    def fill(self, rows: list[tuple], num_rows: int) -> np.ndarray:
        """int32[num_rows, W]: row r of each (matcher, r) holds its next-token mask (padded ids
        banned); with drafts, (matcher, r, [d1..dk]) (a verify step's window; the drafts valid for
        the grammar: `valid_drafts`), rows r + 1..r + k hold the masks after d1..dj, the matcher
        left as it was. Every other row is -1 (all allowed)."""
        job = self._fill_job(rows, num_rows)
        self._fill_run(*job)
        return self._fill_done(*job)

    def fill_async(self, rows: list[tuple], num_rows: int,
                   before: Callable[[], None] | None = None) -> Callable[[], np.ndarray]:
        """`fill` on a helper thread, after `before()` there if given (the engine's: wait for the
        previous step's samples and feed them to the grammars): returns a function that waits for
        the masks and returns them. llguidance fills with the GIL released, so the caller's Python
        runs meanwhile; no matcher of `rows` may be used until that function has returned
        (llguidance holds them)."""
        job = self._fill_job(rows, num_rows)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="metrale-masks")
        started = threading.Event()

        def work():
            started.set()
            if before is not None:
                before()
            self._fill_run(*job)

        fut = self._pool.submit(work)
        # wait until the helper holds the GIL and is about to enter llguidance (which drops it):
        # otherwise it would wait for this thread to block, or for Python's 5 ms switch interval
        started.wait()

        def masks() -> np.ndarray:
            fut.result()  # (re-raises what the fill raised)
            return self._fill_done(*job)
        return masks

    def _fill_job(self, rows, num_rows):
        """(out int32[num_rows, llguidance's W], plain rows, rows with drafts) of a `fill`."""
        out = np.full((num_rows, self._llg_width), -1, np.int32)
        plain = [(m, r) for m, r, *d in rows if not (d and len(d[0]))]
        drafted = [(m, r, list(d[0])) for m, r, *d in rows if d and len(d[0])]
        return out, plain, drafted

    def _fill_run(self, out, plain, drafted) -> None:
        llg = _llguidance().numpy
        if drafted:  # (llguidance's draft fill takes rows with drafts only)
            llg.fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, out)
        if plain:
            llg.fill_next_token_bitmask_par(self._executor, plain, out)

    def _fill_done(self, out, plain, drafted) -> np.ndarray:
        """`out` cut or padded to the model's width, padded ids banned in the filled rows."""
        if self._llg_width != self.width:
            out = np.ascontiguousarray(out[:, : self.width]) if self._llg_width > self.width else np.pad(
                out, ((0, 0), (0, self.width - self._llg_width)), constant_values=-1)
        idx = [r for _, r in plain] + [r + j for _, r, d in drafted for j in range(len(d) + 1)]
        lo = self._valid_from
        out[idx, lo:] &= self.valid_row[lo:]  # (the words before `lo` are all valid ids)
        return out

    def consume(self, pairs: list[tuple[Any, int]]) -> list[bool]:
        """Feed each (matcher, token) its token, in parallel -> whether each took it; a matcher that
        rejects its token is left in an error state (`LLMatcher.is_error`)."""
        return _llguidance().numpy.consume_token_par(self._executor, pairs) if pairs else []

    @staticmethod
    def valid_drafts(matcher, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the grammar accepts from `matcher`'s state (unchanged)."""
        return list(drafts[: matcher.validate_tokens(list(drafts))]) if drafts else []

    @staticmethod
    def forced_drafts(matcher, drafts: list[int], k: int) -> list[int]:
        """A constrained row's drafts for a verify step, with jump-forward: the tokens its grammar
        forces next (llguidance's `compute_ff_tokens`: a JSON key, a closing quote and colon), which
        verification accepts since their masks allow nothing else, then the proposed `drafts` where
        they continue them; the longest prefix the grammar accepts, at most k. (Speculative decoding
        only: without it no step takes more than one token a row.)"""
        forced = list(matcher.compute_ff_tokens())[:k] if k > 0 else []
        if forced and list(drafts[:len(forced)]) != forced:
            drafts = forced
        return GrammarCompiler.valid_drafts(matcher, list(drafts)[:k])


__all__ = ["StructuredOutputsParams", "GrammarCompiler", "grammar_text", "packed_width"]
