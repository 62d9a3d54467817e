"""Several processes (`jax.distributed` on localhost), for tests/test_tensor_parallel.py.

    python -m tests.mh_check --process-id I --num-processes 2 --port P --family llama_tiny

Every process builds the same engine over all processes' devices; process 0 runs the requests of
tests/tp_check.py through `LLM.generate` and prints one JSON line per request (ids, logprobs),
the others follow it (`LLMEngine.follow_leader`).
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--family", default="llama_tiny")
    ap.add_argument("--spec-refs", default=None,
                    help="JSON file of the one-device outputs: speculative decoding with drafts from them")
    args = ap.parse_args(argv)

    import jax

    # two processes must not write JAX's persistent cache at once (tests.conftest, imported by the
    # speculative case, turns it on): a half-written entry crashes a later run that reads it
    jax.config.update("jax_enable_compilation_cache", False)

    jax.distributed.initialize(f"127.0.0.1:{args.port}", num_processes=args.num_processes,
                               process_id=args.process_id)
    from tests.tp_check import run_family

    refs = None
    if args.spec_refs:
        with open(args.spec_refs) as f:
            refs = [(ids, None) for ids in json.load(f)]
    res = run_family(args.family, jax.device_count(), False, False, follower=jax.process_index() != 0,
                     spec_refs=refs)
    if res is not None:
        for ids, lps in res[0]:
            print(json.dumps(dict(ids=ids, logprobs=lps.tolist())), flush=True)
        print(json.dumps(dict(preemptions=res[1].num_preemptions, swaps=res[1].num_swaps)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
