"""Online serving benchmark: Poisson arrivals at a fixed rate against an OpenAI-compatible server.

    # against a running server
    python bench/serve.py --url http://127.0.0.1:8000 --rate 4 --num-requests 64
    # or start `python -m metrale_jax.server MODEL ...` here, wait for it, measure, stop it
    python bench/serve.py --launch smollm2 --rate 2 --num-requests 32 -- --max-num-seqs 16

Every request streams from /v1/completions with a random token-id prompt (fixed seed), a fixed
number of output tokens (`ignore_eos`) and greedy sampling. The arrival times and prompts
depend only on --seed. Reported (p50/p99):
- TTFT: send -> first chunk carrying text;
- ITL: gaps between consecutive chunks that carry text (a chunk usually holds one token);
- TPOT: (last chunk - first chunk) / (output tokens - 1), per request;
- throughput: output tokens / wall time from the first send to the last finish.
Results (plus device, versions, date) go to --out as JSON, and a summary to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Result:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str | None = None


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    res = Result(ok=False, prompt_len=len(prompt))
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if obj.get("usage"):
                    res.output_tokens = obj["usage"]["completion_tokens"]
                if "error" in obj:
                    res.error = str(obj["error"])
                    return res
                if obj.get("choices") and obj["choices"][0].get("text"):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
        res.latency = time.perf_counter() - t0
        res.ok = res.ttft is not None
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"p50": None, "p99": None, "mean": None}
    a = np.asarray(xs) * 1e3
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "mean": float(a.mean())}


async def run_bench(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(args.seed)
    n = args.num_requests
    gaps = rng.exponential(1.0 / args.rate, size=n)
    arrivals = np.cumsum(gaps) - gaps[0]
    in_lens = rng.integers(args.input_len[0], args.input_len[1] + 1, size=n)
    prompts = [rng.integers(args.token_id_range[0], args.token_id_range[1], size=int(k)).tolist() for k in in_lens]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=args.timeout, limits=limits) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        # warm-up (not timed): one request, so first-request effects stay out of the figures
        await one_request(client, model, prompts[0], 4)
        before = (await client.get("/metrics")).text
        t_start = time.perf_counter()

        async def launch(i: int) -> Result:
            await asyncio.sleep(max(0.0, t_start + arrivals[i] - time.perf_counter()))
            return await one_request(client, model, prompts[i], args.output_len)

        results = await asyncio.gather(*(launch(i) for i in range(n)))
        wall = time.perf_counter() - t_start
        metrics_text = (await client.get("/metrics")).text
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1 and r.ttft is not None]
    summary = {
        "model": model,
        "num_requests": n, "completed": len(ok), "failed": n - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "rate_req_per_s": args.rate, "seed": args.seed,
        "input_len_range": list(args.input_len), "output_len": args.output_len,
        "duration_s": wall,
        "request_throughput_req_per_s": len(ok) / wall,
        "output_throughput_tok_per_s": out_tokens / wall,
        "total_output_tokens": out_tokens,
        "total_input_tokens": int(sum(r.prompt_len for r in ok)),
        "ttft_ms": percentiles([r.ttft for r in ok]),
        "itl_ms": percentiles([x for r in ok for x in r.itl]),
        "tpot_ms": percentiles(tpot),
        "e2e_latency_ms": percentiles([r.latency for r in ok]),
        "server_kv_blocks_used_after": _metric(metrics_text, "metrale_kv_blocks_used"),
    }
    steps = _delta(before, metrics_text, "metrale_engine_steps_total")
    if steps:
        summary["server_engine_steps"] = steps
        summary["server_mean_step_ms"] = 1e3 * wall / steps  # includes idle time between arrivals
        summary["server_generation_tokens"] = _delta(before, metrics_text, "metrale_generation_tokens_total")
    return summary


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def _delta(before: str, after: str, name: str) -> float | None:
    a, b = _metric(before, name), _metric(after, name)
    return None if a is None or b is None else b - a


def environment() -> dict:
    env = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "python": platform.python_version(),
           "platform": platform.platform(), "cpu": platform.processor() or platform.machine(),
           "cpu_count": os.cpu_count(), "load_average_1_5_15": list(os.getloadavg())}
    try:
        env["git_rev"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    for mod in ("jax", "jaxlib", "fastapi", "uvicorn", "httpx"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a missing package is just not reported
            pass
    return env


def launch_server(model: str, port: int, extra: list[str], log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "metrale_jax.server", model, "--port", str(port), "--log-level", "warning",
           "--max-waiting-requests", "100000", *extra]
    print("launching:", " ".join(cmd), flush=True)
    log = open(log_path, "w")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError("server did not become healthy")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    server_extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, server_extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--launch", metavar="MODEL", help="start `python -m metrale_jax.server MODEL` for the run")
    p.add_argument("--port", type=int, default=8123, help="port for --launch")
    p.add_argument("--model", help="model name to send (default: the server's first)")
    p.add_argument("--api-key")
    p.add_argument("--rate", type=float, default=2.0, help="mean arrival rate, requests/s (Poisson)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--input-len", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--token-id-range", type=int, nargs=2, default=[100, 1000], metavar=("LO", "HI"),
                   help="prompt token ids are drawn uniformly from [LO, HI)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--label", default="", help="free text stored with the results (e.g. the device)")
    p.add_argument("--out", type=Path, help="write the results JSON here")
    args = p.parse_args(argv)

    proc = None
    if args.launch:
        args.url = f"http://127.0.0.1:{args.port}"
        log_path = Path(os.environ.get("TMPDIR", "/tmp")) / "metrale_bench_serve.log"
        t0 = time.perf_counter()
        proc = launch_server(args.launch, args.port, server_extra, log_path)
        print(f"server healthy after {time.perf_counter() - t0:.1f}s", flush=True)
    try:
        summary = asyncio.run(run_bench(args))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    record = {"bench": "serve", "label": args.label, "server": args.launch or args.url,
              "server_args": server_extra, **summary, "environment": environment()}
    print(json.dumps({k: v for k, v in record.items() if k != "environment"}, indent=1))
    for name in ("ttft_ms", "itl_ms", "tpot_ms"):
        s = summary[name]
        if s["p50"] is not None:
            print(f"{name:8s} p50 {s['p50']:9.1f}  p99 {s['p99']:9.1f}")
    print(f"throughput {summary['output_throughput_tok_per_s']:.1f} tok/s, "
          f"{summary['request_throughput_req_per_s']:.2f} req/s, {summary['completed']}/{summary['num_requests']} ok")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
