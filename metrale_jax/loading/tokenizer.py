"""Tokenizer, chat template and incremental detokenizer.

`Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust library; no BPE here is hand-written). It is
built either from a Hugging Face folder (`tokenizer.json` + `tokenizer_config.json`) or from the
`tokenizer.*` metadata of a GGUF file. Chat templates are rendered with jinja2 in a sandboxed
environment configured the way transformers configures it, so templates render byte-identically.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from metrale_jax.errors import CorruptCheckpointError, LoadError

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED, _TOKEN_UNUSED, _TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Split regexes of llama.cpp's pre-tokenizer types (tokenizer.ggml.pre) that differ from GPT-2's.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp pre types that split every digit, then apply GPT-2's regex (StarCoder-style vocabularies,
# SmolLM among them). tokenizers' `Digits(individual_digits=True)` splits on `char::is_numeric`,
# the same class as llama.cpp's `\p{N}`.
_DIGITS_THEN_GPT2 = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"})
_GPT2_PLAIN = frozenset({"default", "gpt2", "gpt-2", "olmo", "jais", "phi-2", "stablelm2", "mpt"})
_SPLIT_THEN_BYTES = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT, "pixtral": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "megrez": _QWEN2_SPLIT,
}


def _byte_level_pre_tokenizer(pre: str | None) -> Any:
    pre = (pre or "default").lower()
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ])
    if pre in _GPT2_PLAIN:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in _SPLIT_THEN_BYTES:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_THEN_BYTES[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ])
    known = sorted(_DIGITS_THEN_GPT2 | _GPT2_PLAIN | set(_SPLIT_THEN_BYTES))
    raise LoadError(f"GGUF pre-tokenizer type tokenizer.ggml.pre={pre!r} is not supported; supported: {known}")


def _token_str(tok: Any) -> str | None:
    """A special-token entry of tokenizer_config.json: a string or {"content": ...}."""
    if tok is None:
        return None
    if isinstance(tok, dict):
        return tok.get("content")
    return str(tok)


# ---- chat templates ------------------------------------------------------------------------------
@lru_cache(maxsize=16)
def _compile_template(source: str) -> Any:
    """Compile a chat template in the environment transformers uses (sandboxed, trim/lstrip blocks)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: transformers tracks assistant spans; we render the body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # Like transformers: no HTML escaping, and the json.dumps options exposed.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


class Tokenizer:
    """A text tokenizer: encode/decode, special tokens, chat template.

    Build it with `Tokenizer.from_dir(path)` or `Tokenizer.from_gguf(reader_or_path)`.
    """

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ):
        self._tok = tok
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.unk_token = unk_token
        self.pad_token = pad_token
        self.chat_template = chat_template
        self.bos_token_id: int | None = self.token_to_id(bos_token) if bos_token is not None else None
        eos = [self.token_to_id(eos_token)] if eos_token is not None else []
        ids: list[int] = []
        for i in [*eos, *extra_eos_token_ids]:
            if i is not None and i not in ids:
                ids.append(int(i))
        self.eos_token_ids: tuple[int, ...] = tuple(ids)
        # transformers' names: the first EOS id (None without one), the padding token's id
        self.eos_token_id: int | None = ids[0] if ids else None
        self.pad_token_id: int | None = self.token_to_id(pad_token) if pad_token is not None else None
        self._special_ids = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)

    # ---- construction ---------------------------------------------------------------------------
    @staticmethod
    def from_dir(path: str | os.PathLike) -> Tokenizer:
        """From a Hugging Face folder: tokenizer.json, tokenizer_config.json, chat_template.jinja."""
        path = Path(path)
        tj = path / "tokenizer.json"
        try:
            tok = tokenizers.Tokenizer.from_file(str(tj))
        except FileNotFoundError as e:
            raise CorruptCheckpointError(f"{tj} is missing") from e
        except Exception as e:  # noqa: BLE001 - the Rust side raises a bare Exception on bad JSON
            raise CorruptCheckpointError(f"{tj}: could not parse tokenizer: {e}") from e
        cfg: dict[str, Any] = {}
        tc = path / "tokenizer_config.json"
        if tc.is_file():
            try:
                cfg = json.loads(tc.read_text(encoding="utf-8"))
            except ValueError as e:
                raise CorruptCheckpointError(f"{tc}: invalid JSON: {e}") from e
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        for fname in ("chat_template.jinja",):
            if (path / fname).is_file():
                template = (path / fname).read_text(encoding="utf-8")
        if template is None and (path / "chat_template.json").is_file():
            try:
                template = json.loads((path / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
            except ValueError as e:
                raise CorruptCheckpointError(f"{path / 'chat_template.json'}: invalid JSON: {e}") from e
        bos, eos = _token_str(cfg.get("bos_token")), _token_str(cfg.get("eos_token"))
        add_bos, add_eos = cfg.get("add_bos_token"), cfg.get("add_eos_token")
        if add_bos is not None or add_eos is not None or tok.post_processor is None:
            # transformers rebuilds the post-processor when tokenizer_config sets either flag
            # explicitly, or when tokenizer.json has none.
            _set_bos_eos_post_processor(tok, bos if add_bos else None, eos if add_eos else None)
        return Tokenizer(
            tok,
            bos_token=bos if bos is not None and tok.token_to_id(bos) is not None else None,
            eos_token=eos if eos is not None and tok.token_to_id(eos) is not None else None,
            unk_token=_token_str(cfg.get("unk_token")),
            pad_token=_token_str(cfg.get("pad_token")),
            chat_template=template,
        )

    @staticmethod
    def from_gguf(reader_or_path: Any) -> Tokenizer:
        """From the `tokenizer.*` metadata of a GGUF file (a path or a gguf.GGUFReader).

        Supports `tokenizer.ggml.model == "gpt2"` (byte-level BPE), with the pre-tokenizer chosen
        by `tokenizer.ggml.pre`. Control tokens become special added tokens, user-defined tokens
        plain added tokens.
        """
        from metrale_jax.loading.tensors import _field_value, open_gguf_reader

        reader = reader_or_path
        if isinstance(reader_or_path, str | os.PathLike):
            reader = open_gguf_reader(reader_or_path)
        get = lambda k, d=None: _field_value(reader, k, d)  # noqa: E731
        model = get("tokenizer.ggml.model")
        if model is None:
            raise LoadError("the GGUF file has no tokenizer (no tokenizer.ggml.model)")
        if model != "gpt2":
            raise LoadError(f"GGUF tokenizer model {model!r} is not supported yet (only byte-level BPE 'gpt2')")
        f_tokens = reader.fields.get("tokenizer.ggml.tokens")
        f_merges = reader.fields.get("tokenizer.ggml.merges")
        if f_tokens is None or f_merges is None:
            raise CorruptCheckpointError("GGUF tokenizer lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
        tokens: list[str] = f_tokens.contents()
        merges = [tuple(m.split(" ", 1)) for m in f_merges.contents()]
        types = get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens)
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise CorruptCheckpointError("GGUF tokenizer.ggml.tokens has duplicate tokens")
        tok = tokenizers.Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                                       end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
        tok.pre_tokenizer = _byte_level_pre_tokenizer(get("tokenizer.ggml.pre"))
        tok.decoder = decoders.ByteLevel()
        special = [AddedToken(t, special=True, normalized=False)
                   for t, ty in zip(tokens, types) if ty == _TOKEN_CONTROL]
        user = [AddedToken(t, special=False, normalized=False)
                for t, ty in zip(tokens, types) if ty == _TOKEN_USER_DEFINED]
        if special:
            tok.add_special_tokens(special)
        if user:
            tok.add_tokens(user)

        def tok_of(key: str) -> str | None:
            i = get(f"tokenizer.ggml.{key}")
            return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

        bos, eos = tok_of("bos_token_id"), tok_of("eos_token_id")
        # llama.cpp's default for BPE vocabularies is to not add BOS unless the file says so.
        add_bos, add_eos = bool(get("tokenizer.ggml.add_bos_token", False)), bool(
            get("tokenizer.ggml.add_eos_token", False))
        _set_bos_eos_post_processor(tok, bos if add_bos else None, eos if add_eos else None)
        extra_eos = [get("tokenizer.ggml.eot_token_id"), get("tokenizer.ggml.eom_token_id")]
        return Tokenizer(
            tok,
            bos_token=bos,
            eos_token=eos,
            unk_token=tok_of("unknown_token_id"),
            pad_token=tok_of("padding_token_id"),
            extra_eos_token_ids=[int(i) for i in extra_eos if i is not None],
            chat_template=get("tokenizer.chat_template"),
        )

    # ---- encode / decode ------------------------------------------------------------------------
    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [list(e.ids) for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(int(i))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    # transformers' names for scripts written against `get_tokenizer()` (vLLM returns an HF tokenizer)
    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True) -> dict[str, Any]:
        """{"input_ids", "attention_mask"} of a text (lists) or of each of several texts (lists of lists)."""
        ids = (self.encode(text, add_special_tokens) if isinstance(text, str)
               else self.encode_batch(text, add_special_tokens))
        mask = [1] * len(ids) if isinstance(text, str) else [[1] * len(i) for i in ids]
        return {"input_ids": ids, "attention_mask": mask}

    def batch_decode(self, sequences: Iterable[Iterable[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(s, skip_special_tokens=skip_special_tokens) for s in sequences]

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> Any:
        if isinstance(tokens, str):
            return self.token_to_id(tokens)
        return [self.token_to_id(t) for t in tokens]

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(self._special_ids)

    def convert_ids_to_tokens(self, ids: int | Iterable[int], skip_special_tokens: bool = False) -> Any:
        if isinstance(ids, int):
            return self.id_to_token(ids)
        return [self.id_to_token(i) for i in ids if not (skip_special_tokens and int(i) in self._special_ids)]

    def is_special(self, i: int) -> bool:
        return int(i) in self._special_ids

    @property
    def special_tokens_map(self) -> dict[str, str]:
        m = {"bos_token": self.bos_token, "eos_token": self.eos_token, "unk_token": self.unk_token,
             "pad_token": self.pad_token}
        return {k: v for k, v in m.items() if v is not None}

    # ---- chat template --------------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        *,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` with the chat template (jinja2, as transformers renders it); the
        defaults are transformers': no generation prompt, token ids.

        With `tokenize=True` the rendered string is encoded with add_special_tokens=False, as
        transformers does (the template writes its own special tokens).
        """
        template = chat_template or self.chat_template
        if template is None:
            raise LoadError("this tokenizer has no chat template; pass chat_template= or send token ids")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are mutually exclusive")
        ctx = {**self.special_tokens_map, **kwargs}
        rendered = _compile_template(template).render(
            messages=list(messages), tools=tools, documents=documents,
            add_generation_prompt=add_generation_prompt, **ctx,
        )
        if continue_final_message:
            final = messages[-1].get("content")
            if not isinstance(final, str) or final.strip() not in rendered:
                raise ValueError("continue_final_message: the final message's content is not in the rendering")
            final = final if final in rendered else final.strip()
            rendered = rendered[: rendered.rindex(final) + len(final)]
        if tokenize:
            return self.encode(rendered, add_special_tokens=False)
        return rendered


def _set_bos_eos_post_processor(tok: tokenizers.Tokenizer, bos: str | None, eos: str | None) -> None:
    """Post-processor that adds `bos` before and `eos` after (either may be None).

    The same TemplateProcessing transformers' `update_post_processor` builds.
    """
    single = f"{bos + ':0 ' if bos else ''}$A:0{' ' + eos + ':0' if eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if bos else ''} $B:1{' ' + eos + ':1' if eos else ''}"
    specials: dict[str, int] = {}
    for t in (bos, eos):
        if t is not None:
            i = tok.token_to_id(t)
            if i is None:
                raise LoadError(f"special token {t!r} is not in the vocabulary")
            specials[t] = i
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(specials.items()))


# ---- incremental detokenization ------------------------------------------------------------------
class IncrementalDetokenizer:
    """Turn a stream of generated token ids into text deltas.

    The algorithm of vLLM's `detokenize_incrementally`: decode a short window of tokens before the
    new ones (`prefix_offset..read_offset`) and the same window plus the new tokens; emit the
    difference once it does not end in U+FFFD (a multi-byte character still split across tokens).
    Decoding a window (not single tokens) keeps byte-level BPE spaces and SentencePiece prefix
    spaces right. Over a `tokenizers` tokenizer the same algorithm runs in Rust
    (`tokenizers.decoders.DecodeStream`, as vLLM's fast detokenizer does: one call per token
    instead of two window decodes: ~2.5x less host time per token); the windows' offsets are kept
    beside it, so a stream the library cannot continue (its "invalid prefix" error) goes on here.
    """

    _INITIAL_OFFSET = 5  # prompt tokens decoded as context before the first generated one

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = [int(i) for i in prompt_ids]
        if skip_special_tokens:
            self.ids = [i for i in self.ids if not tokenizer.is_special(i)]
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - self._INITIAL_OFFSET, 0)
        self.text = ""
        self._backend = getattr(tokenizer, "backend", None)
        self._stream = None
        stream = getattr(decoders, "DecodeStream", None)  # (tokenizers >= 0.21)
        if stream is not None and isinstance(self._backend, tokenizers.Tokenizer):
            self._stream = stream(skip_special_tokens=skip_special_tokens)
            context = self.ids[self.prefix_offset:]
            # primed with the prompt's last tokens (their text discarded); a prompt that ends inside
            # a character leaves the stream unprimed: the window decode handles it
            if context and self._step(context) is None:
                self._stream = None

    def _step(self, ids: int | list[int]) -> str | None:
        try:
            return self._stream.step(self._backend, ids)
        except Exception:  # noqa: BLE001 - the library's "invalid prefix": continue with the window decode
            self._stream = None
            return None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Feed one token id; return the text it completes ("" while a character is incomplete)."""
        token_id = int(token_id)
        if self.skip_special_tokens and self.tokenizer.is_special(token_id):
            return ""
        self.ids.append(token_id)
        if self._stream is not None:
            delta = self._step(token_id)
            if self._stream is not None:  # (None: it failed on this token, decoded below)
                return self._emit(delta) if delta else ""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            return self._emit(new_text[len(prefix_text):])
        return ""

    def _emit(self, delta: str) -> str:
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a stream: emit what is still held back (incomplete bytes decode as U+FFFD)."""
        if self.read_offset == len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        delta = new_text[len(prefix_text):] if new_text.startswith(prefix_text) else ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta
