"""vLLM's metric names beside tpserve's, so dashboards and inference gateways built for vLLM read
this server: the load gauges, the token counters and the latency histograms, each with vLLM's
`model_name` label. Same registry, same sources as tpserve's own series (tpserve/server/metrics.py); the
gauges are read from the lane host's stats at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
REQUEST_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)


class _LoadCollector:
    """vllm:num_requests_running, vllm:num_requests_waiting and vllm:kv_cache_usage_perc (a fraction
    of the KV room reserved by open lanes, as vLLM's), read when Prometheus scrapes."""

    def __init__(self, read_stats: Callable[[], Any], model_name: str):
        self._read_stats = read_stats
        self._model_name = model_name

    def describe(self):
        return []  # no early collect() at registration (it would read the lane host)

    def collect(self):
        stats = self._read_stats()
        usage = stats.room_used / stats.room if stats.room else 0.0
        for name, help_text, value in (
            ("vllm:num_requests_running", "Requests on a lane (prefilling or decoding)", stats.lanes_busy),
            ("vllm:num_requests_waiting", "Requests waiting for a lane", stats.queued),
            ("vllm:kv_cache_usage_perc", "Fraction of the KV blocks streams hold (1 is full)", usage),
        ):
            family = GaugeMetricFamily(name, help_text, labels=["model_name"])
            family.add_metric([self._model_name], value)
            yield family


class VllmMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, read_stats: Callable[[], Any] | None):
        self._labels = {"model_name": model_name}
        labels = ["model_name"]

        def histogram(name: str, help_text: str, buckets) -> Histogram:
            return Histogram(name, help_text, labels, buckets=buckets, registry=registry)

        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token", LATENCY_BUCKETS_S
        )
        self.inter_token = histogram(
            "vllm:inter_token_latency_seconds", "Time between tokens", LATENCY_BUCKETS_S
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Submission to the last token", REQUEST_BUCKETS_S
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens", labels, registry=registry)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generated tokens", labels, registry=registry
        )
        self.request_success = Counter(
            "vllm:request_success",
            "Finished requests by reason",
            [*labels, "finished_reason"],
            registry=registry,
        )
        if read_stats is not None:
            registry.register(_LoadCollector(read_stats, model_name))

    def observe_finished(
        self, reason: str, prompt_tokens: int, completion_tokens: int, total_s: float
    ) -> None:
        self.prompt_tokens.labels(**self._labels).inc(prompt_tokens)
        self.generation_tokens.labels(**self._labels).inc(completion_tokens)
        self.request_success.labels(**self._labels, finished_reason=reason).inc()
        self.e2e.labels(**self._labels).observe(total_s)

    def observe_first_token(self, seconds: float) -> None:
        self.time_to_first_token.labels(**self._labels).observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.inter_token.labels(**self._labels).observe(seconds)
