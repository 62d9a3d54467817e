"""xgrammar vs llguidance on the CPU: what picking the grammar library for structured output rests on.

For each library: build its tokenizer view of SmolLM2's vocabulary (49,152 tokens), compile a
realistic nested JSON schema (`SCHEMA`: nested objects, an array of objects, enums, integers and
numbers with bounds, a string pattern), then walk a valid document token by token: fill the next
token's packed bitmask (int32[ceil(V/32)]), check the document's token is allowed, accept it.
Also a batch of 8 matchers filled per step (llguidance: `fill_next_token_bitmask_par`; xgrammar:
`BatchGrammarMatcher` when present, else one matcher after another).

xgrammar imports torch (its wheel requires torch, transformers and triton), so this script runs in
any interpreter that has the libraries and `tokenizers`, not necessarily the project's venv:

    python bench/grammar_libs.py --tokenizer-json /tmp/smol_tok.json --out bench/results/grammar_libs_cpu.json

(`--tokenizer-json` is written by `python bench/grammar_libs.py --write-tokenizer PATH` from the
project venv: the GGUF's tokenizer as `tokenizers` JSON.)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999999},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,3}$"},
                "tier": {"enum": ["free", "pro", "enterprise"]},
                "address": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                   "country": {"enum": ["FR", "DE", "US", "JP"]}},
                    "required": ["city", "country"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "tier", "address"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 5,
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
                               "price": {"type": "number", "minimum": 0}, "gift": {"type": "boolean"}},
                "required": ["sku", "qty", "price"],
                "additionalProperties": False,
            },
        },
        "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
        "notes": {"type": ["string", "null"]},
    },
    "required": ["id", "customer", "items", "status"],
    "additionalProperties": False,
}

DOCUMENT = {
    "id": 4217,
    "customer": {"name": "Ada Lovelace", "email": "ada@example.com", "tier": "pro",
                 "address": {"city": "London", "zip": "12345", "country": "US"}},
    "items": [{"sku": "AB-12", "qty": 2, "price": 19.99, "gift": False},
              {"sku": "ZX-9", "qty": 1, "price": 250.0}],
    "status": "paid",
    "notes": None,
}


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median_us": round(statistics.median(xs) * 1e6, 1), "mean_us": round(statistics.fmean(xs) * 1e6, 1),
            "p90_us": round(xs[int(0.9 * (len(xs) - 1))] * 1e6, 1), "max_us": round(xs[-1] * 1e6, 1), "n": len(xs)}


def _allowed(mask_row: np.ndarray, tok: int) -> bool:
    return bool((int(mask_row[tok >> 5]) >> (tok & 31)) & 1)


def bench_llguidance(tok_json: str, eos: int, doc_ids: list[int], batch: int, reps: int) -> dict:
    import llguidance
    import llguidance.numpy as lln

    t = time.perf_counter()
    lt = llguidance.LLTokenizer(tok_json, eos_token=eos)
    t_tok = time.perf_counter() - t
    v = lt.vocab_size
    compiles = []
    for _ in range(reps):
        t = time.perf_counter()
        g = llguidance.LLMatcher.grammar_from_json_schema(
            SCHEMA, defaults={"whitespace_flexible": False})
        m = llguidance.LLMatcher(lt, g)
        compiles.append(time.perf_counter() - t)
        assert not m.is_error(), m.get_error()
    mask = lln.allocate_token_bitmask(batch, v)
    per_tok = []
    m = llguidance.LLMatcher(lt, g)
    for tid in doc_ids:
        t = time.perf_counter()
        lln.fill_next_token_bitmask(m, mask, 0)
        per_tok.append(time.perf_counter() - t)
        assert _allowed(mask[0], tid), f"llguidance bans document token {tid}"
        assert m.consume_token(tid), m.get_error()
    lln.fill_next_token_bitmask(m, mask, 0)
    assert _allowed(mask[0], eos) and m.is_accepting()
    # a batch of matchers, one parallel fill per step (+ the accepts)
    ex = llguidance.LLExecutor()
    ms = [llguidance.LLMatcher(lt, g) for _ in range(batch)]
    per_step = []
    for tid in doc_ids:
        t = time.perf_counter()
        lln.fill_next_token_bitmask_par(ex, [(mm, i) for i, mm in enumerate(ms)], mask)
        for mm in ms:
            mm.consume_token(tid)
        per_step.append(time.perf_counter() - t)
    ms = [llguidance.LLMatcher(lt, g) for _ in range(batch)]
    per_step_seq = []  # one matcher after another on the calling thread
    for tid in doc_ids:
        t = time.perf_counter()
        for i, mm in enumerate(ms):
            lln.fill_next_token_bitmask(mm, mask, i)
        for mm in ms:
            mm.consume_token(tid)
        per_step_seq.append(time.perf_counter() - t)
    return {"library": "llguidance", "version": _version("llguidance"), "vocab": v,
            "tokenizer_build_s": round(t_tok, 3), "compile_ms": [round(c * 1e3, 2) for c in compiles],
            "mask_per_token": _stats(per_tok), f"batch{batch}_fill_and_accept_per_step": _stats(per_step),
            f"batch{batch}_sequential_fill_and_accept_per_step": _stats(per_step_seq)}


def bench_xgrammar(tok_json: str, eos: int, doc_ids: list[int], batch: int, reps: int) -> dict:
    import torch
    import transformers
    import xgrammar as xgr

    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=__import__("tokenizers").Tokenizer.from_str(tok_json))
    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, stop_token_ids=[eos])
    t_tok = time.perf_counter() - t
    v = info.vocab_size
    compiles = []
    for _ in range(reps):  # a fresh compiler each time: no compile cache hit
        comp = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        t = time.perf_counter()
        cg = comp.compile_json_schema(SCHEMA, any_whitespace=False, separators=(",", ":"))
        compiles.append(time.perf_counter() - t)
    mask = np.full((batch, (v + 31) // 32), -1, np.int32)
    tmask = torch.from_numpy(mask)  # a view: xgrammar writes through data_ptr
    per_tok = []
    m = xgr.GrammarMatcher(cg)
    for tid in doc_ids:
        t = time.perf_counter()
        m.fill_next_token_bitmask(tmask, 0)
        per_tok.append(time.perf_counter() - t)
        assert _allowed(mask[0], tid), f"xgrammar bans document token {tid}"
        assert m.accept_token(tid)
    m.fill_next_token_bitmask(tmask, 0)
    assert _allowed(mask[0], eos)
    ms = [xgr.GrammarMatcher(cg) for _ in range(batch)]
    bm = xgr.BatchGrammarMatcher(max_threads=2) if hasattr(xgr, "BatchGrammarMatcher") else None
    per_step = []
    for tid in doc_ids:
        t = time.perf_counter()
        if bm is not None:
            bm.batch_fill_next_token_bitmask(ms, tmask)
        else:
            for i, mm in enumerate(ms):
                mm.fill_next_token_bitmask(tmask, i)
        for mm in ms:
            mm.accept_token(tid)
        per_step.append(time.perf_counter() - t)
    return {"library": "xgrammar", "version": _version("xgrammar"), "vocab": v, "torch": torch.__version__,
            "tokenizer_build_s": round(t_tok, 3), "compile_ms": [round(c * 1e3, 2) for c in compiles],
            "mask_per_token": _stats(per_tok), f"batch{batch}_fill_and_accept_per_step": _stats(per_step),
            "batch_api": "BatchGrammarMatcher" if bm is not None else "loop"}


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer-json", help="tokenizers JSON of the vocabulary (see --write-tokenizer)")
    ap.add_argument("--write-tokenizer", help="write SmolLM2 GGUF's tokenizer JSON here and exit (project venv)")
    ap.add_argument("--libs", default="llguidance,xgrammar")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.write_tokenizer:
        from metrale_jax.loading.checkpoint import open_checkpoint
        from metrale_jax.loading.hub import DEFAULT_MODEL, resolve_model

        ck = open_checkpoint(resolve_model(DEFAULT_MODEL))
        with open(a.write_tokenizer, "w") as f:
            f.write(ck.tokenizer._tok.to_str())
        print(json.dumps({"eos_token_ids": list(ck.tokenizer.eos_token_ids)}))
        return
    import tokenizers

    tok_json = open(a.tokenizer_json).read()
    tk = tokenizers.Tokenizer.from_str(tok_json)
    eos = tk.token_to_id("<|im_end|>")
    eos = 2 if eos is None else eos
    doc = json.dumps(DOCUMENT, separators=(",", ":"))
    doc_ids = tk.encode(doc, add_special_tokens=False).ids
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "python": sys.version.split()[0],
           "machine": platform.machine(), "cpus": __import__("os").cpu_count(), "document_tokens": len(doc_ids),
           "schema": "bench/grammar_libs.py SCHEMA", "whitespace": "compact (no free whitespace)", "results": []}
    for lib in a.libs.split(","):
        fn = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar}[lib]
        try:
            r = fn(tok_json, eos, doc_ids, a.batch, a.reps)
        except ImportError as e:
            r = {"library": lib, "skipped": f"{type(e).__name__}: {e}"}
        res["results"].append(r)
        print(json.dumps(r), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
