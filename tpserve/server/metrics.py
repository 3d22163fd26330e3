"""Prometheus metrics of rank 0: requests, tokens, latencies and the lane host's load.

Everything lives in this object's own CollectorRegistry (never prometheus_client's global one), so
several servers (or tests) in one process keep separate counts. The lane host's gauges (queue depth,
lanes busy, room used) and counters (draft tokens checked and accepted) are read from
`LaneHost.stats()` at scrape time, never pushed; so are the KV blocks' and prompt cache's counters
and gauges (lookups, hit tokens, evictions, cached and used blocks) from `LaneHost.block_stats()`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tpserve.server.kv_blocks import BlockStats
from tpserve.server.metrics_port import serve_metrics
from tpserve.server.vllm_metrics import VllmMetrics

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


# What the collectors read at scrape time: (series, help, the stats field), counters then gauges.
# Tables of data: their rows look alike by nature.
HOST_COUNTERS = (
    ("tpserve_draft_tokens", "Draft tokens decode rounds checked", "draft_tokens"),
    (
        "tpserve_draft_tokens_accepted",
        "Draft tokens the model agreed with (each saved a decode round)",
        "draft_tokens_accepted",
    ),
    ("tpserve_preemptions", "Streams that gave up their lane for want of KV blocks", "preempted"),
)
HOST_GAUGES = (
    ("tpserve_queue_depth", "Requests waiting for a lane", "queued"),
    ("tpserve_lanes_busy", "Lanes running a stream", "lanes_busy"),
    ("tpserve_lanes", "Lanes in all", "num_lanes"),
    ("tpserve_room_used_tokens", "KV tokens the open lanes' blocks hold", "room_used"),
    ("tpserve_room_tokens", "KV tokens the ranks can hold in all", "room"),
)
CACHE_COUNTERS = (
    ("tpserve_prompt_cache_hit_tokens", "Prompt tokens shared cached blocks supplied", "hit_tokens"),
    ("tpserve_prompt_cache_evictions", "Cached blocks reused for other KV", "evictions"),
)
CACHE_GAUGES = (
    ("tpserve_prompt_cache_blocks", "KV blocks holding a prefix a later prompt may share", "num_cached"),
    ("tpserve_kv_blocks_used", "KV blocks the streams hold", "num_used"),
    ("tpserve_kv_blocks", "KV blocks in all", "num_blocks"),
    ("tpserve_kv_block_size", "Tokens per KV block", "block_size"),
)


# What the collectors read at scrape time: (series, help, the stats field), counters then gauges.


def _families(stats, counters, gauges):
    """One snapshot's counters and gauges, as the tables above name them."""
    for name, help_text, field in counters:
        yield CounterMetricFamily(name, help_text, value=getattr(stats, field))
    for name, help_text, field in gauges:
        yield GaugeMetricFamily(name, help_text, value=getattr(stats, field))


class _LaneHostCollector:
    """Reads the lane host's stats when Prometheus scrapes."""

    def __init__(self, read_stats: Callable[[], Any]):
        self._read_stats = read_stats

    def describe(self):
        # Describing nothing keeps registration from calling collect() (and so the lane host) early.
        return []

    def collect(self):
        yield from _families(self._read_stats(), HOST_COUNTERS, HOST_GAUGES)


class _BlocksCollector:
    """Reads the KV blocks' counters and gauges when Prometheus scrapes (one consistent snapshot)."""

    def __init__(self, read_blocks: Callable[[], BlockStats]):
        self._read_blocks = read_blocks

    def describe(self):
        return []  # as for the lane host: no early collect() at registration

    def collect(self):
        stats = self._read_blocks()
        lookups = CounterMetricFamily(
            "tpserve_prompt_cache_lookups",
            "Prompt-cache lookups by result: hit (shared at least one cached block) or miss",
            labels=["result"],
        )
        lookups.add_metric(["hit"], stats.hits)
        lookups.add_metric(["miss"], stats.lookups - stats.hits)
        yield lookups
        yield from _families(stats, CACHE_COUNTERS, CACHE_GAUGES)


class ServingMetrics:
    """The counters and histograms the servicer updates, plus an HTTP endpoint serving them."""

    def __init__(
        self,
        read_stats: Callable[[], Any] | None = None,
        read_blocks: Callable[[], BlockStats] | None = None,
        model_name: str = "",
    ):
        self.registry = CollectorRegistry()
        # vLLM's names beside these (tpserve/server/vllm_metrics.py), when the model's name is known.
        self.vllm = VllmMetrics(self.registry, model_name, read_stats) if model_name else None
        self.requests = Counter(
            "tpserve_requests",
            "Generate calls by outcome: a finish reason (stop, length, cancelled, error) or a refusal's "
            "status code (invalid_argument, resource_exhausted, ...)",
            ["outcome"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "tpserve_prompt_tokens", "Prompt tokens of finished streams", registry=self.registry
        )
        self.completion_tokens = Counter(
            "tpserve_completion_tokens", "Tokens generated", registry=self.registry
        )
        self.cached_tokens = Counter(
            "tpserve_cached_prompt_tokens",
            "Prompt tokens taken from the prompt cache instead of prefilled",
            registry=self.registry,
        )
        self.cache_hits = Counter(
            "tpserve_prompt_cache_hits", "Streams that reused part of a cached prompt", registry=self.registry
        )
        self.time_to_first_token = Histogram(
            "tpserve_time_to_first_token_seconds",
            "From submission to the first generated token",
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.inter_token = Histogram(
            "tpserve_inter_token_seconds",
            "Between consecutive token messages of one stream, divided by the tokens they carry",
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        if read_stats is not None:
            self.registry.register(_LaneHostCollector(read_stats))
        if read_blocks is not None:
            self.registry.register(_BlocksCollector(read_blocks))
        self._http_server = None
        self._http_thread = None

    def count_outcome(self, outcome: str) -> None:
        self.requests.labels(outcome=outcome).inc()

    def count_usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        self.cached_tokens.inc(cached_tokens)
        if cached_tokens > 0:
            self.cache_hits.inc()

    def observe_first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)
        if self.vllm is not None:
            self.vllm.observe_first_token(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.inter_token.observe(seconds)
        if self.vllm is not None:
            self.vllm.observe_inter_token(seconds)

    def observe_finished(
        self, reason: str, prompt_tokens: int, completion_tokens: int, total_s: float
    ) -> None:
        """vLLM's per-request series (tpserve's own are count_outcome and count_usage)."""
        if self.vllm is not None:
            self.vllm.observe_finished(reason, prompt_tokens, completion_tokens, total_s)

    def render(self) -> bytes:
        """The text exposition format, as a scrape would see it."""
        return generate_latest(self.registry)

    def serve(self, port: int, host: str = "0.0.0.0", api_key: str | None = None) -> int:
        """Serves /metrics over HTTP on its own port (0 picks a free one); returns the bound port.
        api_key: None serves anyone (prometheus_client's server); a string serves behind that key
        ("" still anyone) on tpserve/server/metrics_port.py's."""
        if self._http_server is not None:
            raise RuntimeError("metrics are already being served")
        if api_key is None:
            self._http_server, self._http_thread = start_http_server(port, addr=host, registry=self.registry)
        else:
            self._http_server, self._http_thread = serve_metrics(self.render, port, host, api_key)
        return self._http_server.server_port

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._http_server is None:
            return
        self._http_server.shutdown()
        self._http_server.server_close()
        self._http_thread.join(timeout=timeout_s)
        self._http_server = self._http_thread = None
