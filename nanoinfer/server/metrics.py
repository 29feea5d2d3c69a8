"""Prometheus metrics for /metrics, in a registry of the app's own (two apps in one process,
as in tests, must not share or clash over the global one).

Engine state (running, waiting, KV blocks, prefix cache, preemptions, speculation) is read at scrape time
from the snapshot the engine thread leaves after each step, so a scrape never waits for the
engine. Per-request numbers (TTFT, inter-token latency, tokens, finish reasons) are observed
when a request ends.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..engine.outputs import RequestOutput

PREFIX = "nanoinfer"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                    0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class EngineCollector(Collector):
    def __init__(self, snapshot):
        self.snapshot = snapshot  # () -> AsyncEngine.metrics dict

    def collect(self):
        m = self.snapshot()
        gauges = [
            ("num_requests_running", "Sequences in the running batch", m["running"]),
            ("num_requests_waiting", "Sequences waiting to be scheduled", m["waiting"]),
            ("kv_cache_blocks_used", "KV cache blocks held by sequences", m["kv_blocks_used"]),
            ("kv_cache_blocks_total", "KV cache blocks in the pool", m["kv_blocks_total"]),
            ("kv_cache_usage_ratio", "Fraction of KV cache blocks held by sequences (0-1)", m["kv_usage"]),
            ("prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt tokens looked up",
             m["prefix_cache_hit_rate"]),
            ("spec_decode_acceptance_rate", "Speculative decoding: accepted guesses / checked guesses",
             m["spec_acceptance_rate"] or 0.0),
            ("spec_decode_mean_accepted_tokens", "Speculative decoding: accepted guesses per step that checked some",
             m["spec_mean_accepted_tokens"] or 0.0),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        counters = [
            ("num_preemptions", "Sequences preempted (KV dropped, recomputed later)", m["preemptions"]),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", m["prefix_cache_queries"]),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache", m["prefix_cache_hits"]),
            ("engine_steps", "Engine steps (forwards)", m["steps"]),
            ("spec_decode_num_draft_tokens", "Speculative decoding: guesses checked", m["spec_proposed_tokens"]),
            ("spec_decode_num_accepted_tokens", "Speculative decoding: guesses accepted", m["spec_accepted_tokens"]),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)


class ServerMetrics:
    def __init__(self, snapshot):
        self.registry = r = CollectorRegistry()
        r.register(EngineCollector(snapshot))
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Time from arrival to the first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "Time between consecutive tokens of a sequence",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "Time from arrival to the last token",
                             buckets=_E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Generated tokens", registry=r)
        self.finished = Counter(f"{PREFIX}_request_success", "Finished sequences by finish reason",
                                ["finish_reason"], registry=r)
        for reason in ("stop", "length", "abort"):
            self.finished.labels(reason)  # present at 0 from the start, so rates work

    def observe(self, out: RequestOutput) -> None:
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        for c, s in zip(out.outputs, out.stats):
            self.generation_tokens.inc(len(c.token_ids))
            self.finished.labels(c.finish_reason or "abort").inc()
            if s.ttft is not None:
                self.ttft.observe(s.ttft)
            for dt in s.inter_token_latencies:
                self.itl.observe(dt)
            if s.e2e_seconds is not None:
                self.e2e.observe(s.e2e_seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
