"""Test support for the server tests (no tests here): a deterministic fake engine with LLMEngine's
API, a tiny character-level tokenizer for the tiny fixture checkpoints, and small HTTP helpers.

The fake engine lets the server's own logic (wire formats, backpressure, cancellation, errors,
a dying engine) be tested in milliseconds; the real engine is tested in tests/test_server.py.
"""

from __future__ import annotations

import json
import math
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from metrale_jax.engine.outputs import CompletionOutput, Logprob, RequestOutput
from metrale_jax.errors import (
    EmptyPromptError,
    InvalidSamplingParamsError,
    InvalidStructuredOutputsError,
    MaxTokensTooLargeError,
    PromptTooLongError,
)
from metrale_jax.sampling import RequestOutputKind, SamplingParams

FIXTURES = Path(__file__).parent / "fixtures" / "data"

# ---- fake engine ------------------------------------------------------------------------------------
VOCAB = 64  # ids 0..63; id 2 is EOS; token t decodes to _PIECES[t]
_PIECES = ["<pad>", "<s>", "</s>"] + [chr(ord("a") + i % 26) + ("" if i < 26 else str(i // 26)) for i in range(61)]


class FakeTokenizer:
    """Characters <-> ids, and a ChatML-ish template rendered without jinja (a `chat_template=`
    argument, the server's --chat-template, is rendered with jinja)."""

    chat_template = "fake"
    eos_token_ids = (2,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [3 + (ord(c) % (VOCAB - 3)) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(_PIECES[i] for i in ids if not (skip_special_tokens and i < 3))

    def __init__(self):
        self.calls: list[dict] = []  # the messages and keyword arguments of each apply_chat_template

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True, **kw):  # (transformers')
        self.calls.append({"messages": messages, **kw})
        for m in messages:
            if m["role"] == "tool":
                raise ValueError("the template does not accept tool messages")
        text = "".join(f"[{m['role']}]{m['content']}" for m in messages) + ("[assistant]" if add_generation_prompt
                                                                             else "")
        if kw.get("chat_template") is not None:
            import jinja2

            text = jinja2.Template(kw["chat_template"]).render(messages=messages,
                                                               add_generation_prompt=add_generation_prompt)
        return self.encode(text) if tokenize else text


def fake_continuation(prompt_ids: list[int], index: int, k: int) -> int:
    """The k-th generated token of output `index` (never EOS unless the pattern hits 2)."""
    return 3 + (sum(prompt_ids) * 31 + 7 * k + 13 * index) % (VOCAB - 3)


@dataclass
class _Seq:
    index: int
    ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list | None = None
    finish: str | None = None
    stop_reason: str | int | None = None
    sent_ids: int = 0  # RequestOutputKind.DELTA: tokens and characters returned already
    sent_text: int = 0

    def output(self, params: SamplingParams) -> CompletionOutput:
        """CUMULATIVE: everything so far; DELTA: what is new, holding back text that could still
        become a stop string (as LLMEngine)."""
        if params.output_kind != RequestOutputKind.DELTA:
            return CompletionOutput(self.index, self.text, list(self.ids), None,
                                    list(self.logprobs) if self.logprobs is not None else None,
                                    self.finish, self.stop_reason)
        hold = max((len(x) for x in params.stop), default=1) - 1
        end = len(self.text) if self.finish is not None else max(0, len(self.text) - hold)
        out = CompletionOutput(self.index, self.text[self.sent_text:end], self.ids[self.sent_ids:], None,
                               self.logprobs[self.sent_ids:] if self.logprobs is not None else None,
                               self.finish, self.stop_reason)
        self.sent_ids, self.sent_text = len(self.ids), max(self.sent_text, end)
        return out


@dataclass
class _Req:
    rid: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[_Seq]
    running: bool = False


class FakeEngine:
    """LLMEngine's server-facing API with deterministic tokens (see `fake_continuation`).

    Each running request holds ceil(len/block_size) blocks per sequence; `max_num_seqs` requests
    run at once, the rest wait. `step_delay_s` slows each step; `fail_after_steps` makes a step raise.
    `script`, when set, is the text every reply is instead: one character a step, then EOS.
    A JSON-schema constraint with the key "x-fake-invalid" is refused as the engine refuses a schema
    that does not compile.
    """

    def __init__(self, *, max_model_len: int = 96, max_num_seqs: int = 4, block_size: int = 4,
                 num_blocks: int = 4096, step_delay_s: float = 0.0, fail_after_steps: int | None = None,
                 max_logprobs: int = 5):
        self.config = SimpleNamespace(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                      max_logprobs=max_logprobs)
        self.tokenizer = FakeTokenizer()
        self.vocab_size = VOCAB
        self.eos_token_ids = (2,)
        self.model_name = "fake-model"
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.step_delay_s = step_delay_s
        self.fail_after_steps = fail_after_steps
        self.max_logprobs = max_logprobs
        self.reqs: dict[str, _Req] = {}
        self.steps = 0
        self.prompt_tokens = 0
        self.gen_tokens = 0
        self.aborted: list[str] = []
        self.thread_ids: set[int] = set()
        self.script: str | None = None

    def _touch(self) -> None:
        self.thread_ids.add(threading.get_ident())

    def add_request(self, request_id: str, prompt, params: SamplingParams) -> None:
        self._touch()
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt["prompt_token_ids"])
        if not ids:
            raise EmptyPromptError("the prompt is empty")
        if len(ids) >= self.config.max_model_len:
            raise PromptTooLongError(f"prompt of {len(ids)} tokens does not fit max_model_len")
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.config.max_model_len:
            raise MaxTokensTooLargeError(f"{len(ids)} prompt + {params.max_tokens} tokens exceed max_model_len "
                                         f"(max_tokens <= {self.config.max_model_len - len(ids)})")
        if any(not 0 <= i < VOCAB for i in ids):
            raise InvalidSamplingParamsError("token id out of range")
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise InvalidSamplingParamsError(f"logprobs {params.logprobs} > max_logprobs {self.max_logprobs}")
        so = params.structured_outputs
        if so is not None and isinstance(so.json, dict) and "x-fake-invalid" in so.json:  # as a compile error
            raise InvalidStructuredOutputsError("json: the schema does not compile (x-fake-invalid)")
        if request_id in self.reqs:
            raise ValueError(f"duplicate {request_id}")
        seqs = [_Seq(i, logprobs=[] if params.logprobs is not None else None) for i in range(params.n)]
        self.reqs[request_id] = _Req(request_id, prompt if isinstance(prompt, str) else None, ids, params, seqs)

    def abort(self, request_id: str) -> None:
        self._touch()
        if self.reqs.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def _blocks(self, r: _Req) -> int:
        return sum(math.ceil((len(r.prompt_ids) + len(s.ids)) / self.block_size) for s in r.seqs if s.finish is None)

    def stats(self):
        running = [r for r in self.reqs.values() if r.running]
        used = sum(self._blocks(r) for r in running)
        return SimpleNamespace(num_waiting=len(self.reqs) - len(running), num_running=len(running),
                               kv_blocks_total=self.num_blocks, kv_blocks_used=used,
                               kv_blocks_free=self.num_blocks - used, ssm_slots_total=0, ssm_slots_used=0,
                               prompt_tokens_total=self.prompt_tokens, generation_tokens_total=self.gen_tokens,
                               num_preemptions=0)

    def step(self) -> list[RequestOutput]:
        self._touch()
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self.steps += 1
        if self.fail_after_steps is not None and self.steps > self.fail_after_steps:
            raise RuntimeError("injected engine failure")
        for r in list(self.reqs.values()):
            if not r.running and sum(x.running for x in self.reqs.values()) < self.config.max_num_seqs:
                r.running = True
                self.prompt_tokens += len(r.prompt_ids)
        outs = []
        for r in list(self.reqs.values()):
            if not r.running:
                continue
            p = r.params
            for s in r.seqs:
                if s.finish is not None:
                    continue
                t = fake_continuation(r.prompt_ids, s.index, len(s.ids))
                s.ids.append(t)
                self.gen_tokens += 1
                if s.logprobs is not None:
                    top = {t: Logprob(-0.25, 1, _PIECES[t])}
                    for j in range(p.logprobs):
                        alt = 3 + (t + 1 + j) % (VOCAB - 3)
                        top.setdefault(alt, Logprob(-1.5 - j, 2 + j, _PIECES[alt]))
                    s.logprobs.append(top)
                full = self.tokenizer.decode(s.ids) if self.script is None else self.script[:len(s.ids)]
                s.text = full
                for st in p.stop:
                    pos = full.find(st)
                    if pos >= 0:
                        s.text = full[:pos + (len(st) if p.include_stop_str_in_output else 0)]
                        s.finish, s.stop_reason = "stop", st
                        break
                if s.finish is None and self.script is not None and len(s.ids) >= len(self.script):
                    s.finish = "stop"
                if s.finish is None and (len(s.ids) >= (p.max_tokens or 10**9)
                                         or len(r.prompt_ids) + len(s.ids) >= self.config.max_model_len):
                    s.finish = "length"
            done = all(s.finish is not None for s in r.seqs)
            if done or p.output_kind != RequestOutputKind.FINAL_ONLY:
                outs.append(RequestOutput(request_id=r.rid, prompt=r.prompt, prompt_token_ids=r.prompt_ids,
                                          prompt_logprobs=None, outputs=[s.output(p) for s in r.seqs],
                                          finished=done))
            if done:
                del self.reqs[r.rid]
        return outs


def expected_fake_text(prompt_ids: list[int], index: int, num_tokens: int, stop: list[str] = ()) -> str:
    text = FakeTokenizer().decode([fake_continuation(prompt_ids, index, k) for k in range(num_tokens)])
    for st in stop:
        if st in text:
            text = text[:text.find(st)]
    return text


# ---- a tiny tokenizer for the tiny fixture checkpoints (vocab 256) ---------------------------------
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_text_model(dst: Path, src: str = "llama_tiny") -> Path:
    """Copy a tiny fixture checkpoint (vocab 256) to `dst` with a character-level tokenizer.

    ids: 0 <pad>, 1 <s> (bos), 2 </s> (eos), 3 <unk>, 4 <|im_start|>, 5 <|im_end|>, then printable
    ASCII and newline one character each, then two-letter pieces up to id 255.
    """
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE

    dst.mkdir(parents=True, exist_ok=True)
    for f in (FIXTURES / src).iterdir():
        if f.suffix in (".json", ".safetensors"):
            shutil.copy(f, dst / f.name)
    specials = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    letters = "etaoinshrdlucmfw"
    for a in letters:
        for b in letters:
            if len(vocab) < 256:
                vocab[a + b] = len(vocab)
    assert len(vocab) == 256
    tok = Tokenizer(BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
        "add_bos_token": True, "chat_template": CHAT_TEMPLATE}))
    return dst


# ---- SSE ------------------------------------------------------------------------------------------
def sse_events(lines) -> list:
    """Parse `data:` lines of an SSE body into JSON objects, with "[DONE]" kept as a string."""
    out = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out
