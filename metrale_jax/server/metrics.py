"""Prometheus metrics for GET /metrics.

Engine gauges and counters are read at scrape time from the engine loop's latest stats snapshot
(a custom collector), so the engine thread never touches prometheus objects. Latency histograms
are observed on the event loop when outputs arrive, which is the latency a client sees, minus
the network. Each server gets its own `CollectorRegistry`, so several servers can live in one
process (tests do).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from metrale_jax.server.engine_loop import StatsSnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], StatsSnapshot], waiting: Callable[[], int], has_ssm: bool):
        self._stats = stats
        self._waiting = waiting
        self._has_ssm = has_ssm

    def collect(self):
        s = self._stats()
        yield GaugeMetricFamily("metrale_num_requests_waiting",
                                "Requests waiting to be scheduled (engine queue plus not yet handed over).",
                                value=self._waiting())
        yield GaugeMetricFamily("metrale_num_requests_running", "Requests in the running batch.",
                                value=s.num_running)
        yield GaugeMetricFamily("metrale_kv_blocks_total", "KV cache blocks in the pool.", value=s.kv_blocks_total)
        yield GaugeMetricFamily("metrale_kv_blocks_used", "KV cache blocks in use.", value=s.kv_blocks_used)
        yield GaugeMetricFamily("metrale_kv_blocks_free", "KV cache blocks free.", value=s.kv_blocks_free)
        usage = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
        yield GaugeMetricFamily("metrale_kv_cache_usage_ratio", "Fraction of KV blocks in use (0 to 1).", value=usage)
        if self._has_ssm or s.ssm_slots_total:
            yield GaugeMetricFamily("metrale_ssm_slots_total", "SSM state pool slots.", value=s.ssm_slots_total)
            yield GaugeMetricFamily("metrale_ssm_slots_used", "SSM state pool slots in use.", value=s.ssm_slots_used)
        yield CounterMetricFamily("metrale_prompt_tokens", "Prompt tokens processed.", value=s.prompt_tokens_total)
        yield CounterMetricFamily("metrale_generation_tokens", "Tokens generated.", value=s.generation_tokens_total)
        yield CounterMetricFamily("metrale_num_preemptions",
                                  "Sequences preempted (swapped to host memory, or recomputed later).",
                                  value=s.num_preemptions)
        yield CounterMetricFamily("metrale_num_swaps", "Sequences swapped out to host memory.",
                                  value=getattr(s, "num_swaps", 0))
        yield GaugeMetricFamily("metrale_num_requests_swapped", "Sequences swapped out now.",
                                value=getattr(s, "num_swapped", 0))
        yield CounterMetricFamily("metrale_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                  value=getattr(s, "prefix_cache_queries", 0))
        yield CounterMetricFamily("metrale_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                  value=getattr(s, "prefix_cache_hits", 0))
        yield CounterMetricFamily("metrale_engine_steps", "Engine steps run by the server.", value=s.num_steps)
        yield CounterMetricFamily("metrale_spec_decode_num_drafts", "Speculative verify rows that carried drafts.",
                                  value=getattr(s, "spec_num_drafts", 0))
        yield CounterMetricFamily("metrale_spec_decode_num_draft_tokens", "Draft tokens verified.",
                                  value=getattr(s, "spec_draft_tokens", 0))
        yield CounterMetricFamily("metrale_spec_decode_num_accepted_tokens",
                                  "Draft tokens accepted (the bonus token excluded).",
                                  value=getattr(s, "spec_accepted_tokens", 0))


class ServerMetrics:
    """The server's registry. `ttft`, `itl`, `e2e` are histograms (seconds); `finished` and
    `rejected` count requests by label, `aborted` the engine requests aborted; `http_in_flight` is
    the number of HTTP generation requests in progress."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram("metrale_time_to_first_token_seconds", "Time to first token, from arrival.",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("metrale_inter_token_latency_seconds", "Time between consecutive output tokens.",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("metrale_e2e_request_latency_seconds", "Request latency, arrival to last token.",
                             buckets=_E2E_BUCKETS, registry=r)
        self.finished = Counter("metrale_request_success", "Finished sequences, by finish reason.",
                                ["finish_reason"], registry=r)
        self.aborted = Counter("metrale_requests_aborted", "Engine requests aborted (client gone or shutdown).",
                               registry=r)
        self.rejected = Counter("metrale_requests_rejected", "Requests rejected, by reason.", ["reason"], registry=r)
        self.http_in_flight = Gauge("metrale_http_requests_in_flight", "HTTP generation requests in progress.",
                                    registry=r)

    def attach_engine(self, stats: Callable[[], StatsSnapshot], waiting: Callable[[], int],
                      has_ssm: bool = False) -> None:
        self.registry.register(_EngineCollector(stats, waiting, has_ssm))

    def render(self) -> bytes:
        return generate_latest(self.registry)
