"""The router's metrics, scraped by Prometheus from ``GET /metrics`` on the router's own port.

Names mirror vLLM's under ``pdserve:`` (a dashboard built for vLLM needs only the prefix changed),
plus the disaggregation's own: KV bytes and seconds per transfer, the transfer time prefill's
compute did not hide, retries and migrations. Two sources:

    this process      per request, as the router sees it (labels: model_name)
                      TTFT, inter-token latency, E2E, queue / prefill / decode time, outcomes,
                      prompt and generation tokens, KV transfer figures (from prefill's reply),
                      the part of TTFT none of those phases explain (router.ttft)
    the replicas      their last reports (``router.routing_state``), read at scrape time
                      (labels: pool, replica): requests running / waiting, KV usage, prefix-cache
                      queries and hits, tickets outstanding, reservation queue, lease expirations

Each RouterMetrics owns its registry (prometheus_client), so two routers in one process (tests)
never collide; the exposition format is prometheus_client's. A bounded window of recent samples
also feeds ``/pdserve/status`` and the load client.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter as Tally
from collections import deque
from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common.serving import PrefillResult, TTFTBreakdown
from router.planner import SLOWindow
from router.request_fields import KNOWN_FIELDS

_WINDOW = 1024  # recent samples kept per series (bounded)
# vLLM's buckets, so that dashboards and recording rules carry over.
# fmt: off
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
_CHOICES_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)
# fmt: on
_PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, *_REQUEST_BUCKETS)
_KV_BYTES_BUCKETS = tuple(float(4**k) for k in range(8, 17))  # 64 KiB … 4 GiB
_LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class RouterMetrics:
    def __init__(
        self, mode: str, model_name: str = "", reports: Callable[[], dict[str, list[dict]]] | None = None
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.mode = mode
        labels = ("model_name",)
        r = self.registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, (*labels, *extra), registry=r)

        self._ttft = histogram("pdserve:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self._ttft_other = histogram(
            "pdserve:time_to_first_token_other_seconds",
            "A request's time to first token less its queue, prefill and exposed KV transfer on the replicas: "
            "the router, the hops, the decode replica's reservation and first emission.",
            _TTFT_BUCKETS,
        )
        self._itl = histogram("pdserve:inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS)
        self._tpot = histogram(
            "pdserve:request_time_per_output_token_seconds",
            "A request's mean time per output token after the first.",
            _ITL_BUCKETS,
        )
        self._e2e = histogram("pdserve:e2e_request_latency_seconds", "Arrival to last token.", _REQUEST_BUCKETS)
        self._queue = histogram(
            "pdserve:request_queue_time_seconds",
            "Arrival on the replica that ran the prompt to its first step.",
            _PHASE_BUCKETS,
        )
        self._prefill = histogram(
            "pdserve:request_prefill_time_seconds", "First step of the prompt to its first token.", _PHASE_BUCKETS
        )
        self._decode = histogram(
            "pdserve:request_decode_time_seconds",
            "First token to last token, as the router sees them.",
            _REQUEST_BUCKETS,
        )
        self._kv_bytes = histogram(
            "pdserve:kv_transfer_bytes", "KV bytes a request's hand-off moved.", _KV_BYTES_BUCKETS
        )
        self._kv_seconds = histogram(
            "pdserve:kv_transfer_seconds", "First KV chunk sent to the last acknowledged, per request.", _PHASE_BUCKETS
        )
        self._kv_exposed = histogram(
            "pdserve:kv_transfer_exposed_seconds",
            "Prompt computed to its KV acknowledged: the transfer time prefill's compute did not hide.",
            _PHASE_BUCKETS,
        )
        self._success = counter("pdserve:request_success_total", "Requests that ended normally.", ("finished_reason",))
        self._failure = counter(
            "pdserve:request_failure_total",
            "Requests refused (reason http_<status>), failed in the cluster (error) or left by the client (cancelled).",
            ("reason",),
        )
        self._refused_fields = counter(
            "pdserve:request_refused_field_total",
            "Requests refused for a field this server does not honour yet (router/request_fields.py), by field.",
            ("field",),
        )
        self._choices = histogram(
            "pdserve:request_choices",
            "Choices a request asked for (n times its prompts), each one request on the pools.",
            _CHOICES_BUCKETS,
        )
        self._prompt_tokens = counter("pdserve:prompt_tokens_total", "Prompt tokens of requests that ran.").labels(
            model_name
        )
        self._generation_tokens = counter("pdserve:generation_tokens_total", "Tokens generated.").labels(model_name)
        self._retries = counter("pdserve:request_retries_total", "Attempts started over before any token.").labels(
            model_name
        )
        self._migrations = counter(
            "pdserve:request_migrations_total", "Streams resumed on another decode replica after theirs was lost."
        ).labels(model_name)
        self._stalls = counter(
            "pdserve:decode_stream_stalls_total",
            "Streams whose decode replica sent no token for inter_token_timeout_s (each then resumes elsewhere).",
        ).labels(model_name)
        prefill_site = counter(
            "pdserve:prefill_site_total",
            "Disaggregated attempts by where their prompt ran: the prefill pool (remote) or their decode replica "
            "(local, conditional disaggregation).",
            ("site",),
        )
        self._prefill_site = {site: prefill_site.labels(model_name, site) for site in ("local", "remote")}
        self._loop_lag = histogram(
            "pdserve:router_event_loop_lag_seconds",
            "How late the router replica's event loop woke a probe sleeping 50 ms: time the loop was held by "
            "work that should not run on it (router.loop_lag).",
            _LOOP_LAG_BUCKETS,
        )
        self._in_flight = Gauge(
            "pdserve:router_requests_in_flight", "Requests the router is serving.", labels, registry=r
        ).labels(model_name)
        self.model_name = model_name
        if reports is not None:
            r.register(ReplicaReportCollector(reports))
        self.recent: dict[str, deque[float]] = {name: deque(maxlen=_WINDOW) for name in ("ttft", "tpot", "e2e")}
        self.outcomes: Tally[str] = Tally()
        self.slo_window: SLOWindow | None = None  # the SLO planner's, when it runs (router.planner_loop)

    # --- a request's life at the router ----------------------------------------------------
    def request_started(self, num_choices: int = 1) -> None:
        self._in_flight.inc()
        self._choices.observe(num_choices)

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)
        self.recent["ttft"].append(seconds)

    def ttft_breakdown(self, breakdown: TTFTBreakdown) -> None:
        """Once per request with a first token, from its last delta: one that failed or was left
        after its first token has no breakdown, so this counts fewer requests than TTFT does. The
        other parts are in the queue, prefill and exposed-transfer series already (observed where
        they arrive, for every attempt)."""
        self._ttft_other.observe(breakdown.other_s)

    def tokens_arrived(self, num_tokens: int, seconds_since_last: float) -> None:
        """``num_tokens`` came in one delta, ``seconds_since_last`` after the one before: each is
        counted at the gap's share (a stream interval of N sends N tokens a delta)."""
        if num_tokens <= 0:
            return
        share = seconds_since_last / num_tokens
        for _ in range(num_tokens):
            self._itl.observe(share)

    def phases(self, queue_time_s: float | None, prefill_time_s: float | None) -> None:
        """The prompt's queue and prefill times on the replica that ran it."""
        if queue_time_s is not None:
            self._queue.observe(queue_time_s)
        if prefill_time_s is not None:
            self._prefill.observe(prefill_time_s)

    def prefill_reply(self, result: PrefillResult) -> None:
        """Prefill's reply (disaggregated): its phases and the hand-off's figures."""
        self.phases(result.queue_time_s, result.prefill_time_s)
        if result.kv_bytes:
            self._kv_bytes.observe(result.kv_bytes)
        if result.kv_transfer_s is not None:
            self._kv_seconds.observe(result.kv_transfer_s)
        if result.kv_exposed_s is not None:
            self._kv_exposed.observe(result.kv_exposed_s)

    def retried(self) -> None:
        self._retries.inc()

    def migrated(self) -> None:
        self._migrations.inc()

    def stalled(self) -> None:
        self._stalls.inc()

    def loop_lag(self, seconds: float) -> None:
        self._loop_lag.observe(seconds)

    def prefill_site(self, local: bool) -> None:
        self._prefill_site["local" if local else "remote"].inc()

    def request_ended(
        self,
        outcome: str | None,
        started: float,
        first_token_time: float | None,
        num_tokens: int,
        num_prompt_tokens: int = 0,
        finish_reason: str | None = None,
    ) -> None:
        """Once per request that reached the pools. ``outcome``: ok, error (failed in the cluster),
        cancelled (the client left), or None (refused: ``request_failed`` counts it). Latencies
        are those of requests that ended normally, as vLLM's are."""
        self._in_flight.dec()
        if outcome is None:
            return
        self._prompt_tokens.inc(num_prompt_tokens)
        self._generation_tokens.inc(num_tokens)
        self.outcomes[outcome] += 1
        if outcome != "ok":
            self._failure.labels(self.model_name, outcome).inc()
            if self.slo_window is not None and outcome == "error":  # a client that left is nobody's miss
                self.slo_window.request_ended(False, prompt_tokens=num_prompt_tokens)
            return
        self._success.labels(self.model_name, finish_reason or "stop").inc()
        now = time.monotonic()
        self._e2e.observe(now - started)
        self.recent["e2e"].append(now - started)
        tpot = None
        if first_token_time is not None:
            self._decode.observe(now - first_token_time)
            if num_tokens > 1:
                tpot = (now - first_token_time) / (num_tokens - 1)
                self._tpot.observe(tpot)
                self.recent["tpot"].append(tpot)
        if self.slo_window is not None:
            ttft = first_token_time - started if first_token_time is not None else None
            self.slo_window.request_ended(True, ttft, tpot, num_prompt_tokens)

    def request_failed(self, status: int, refused_field: str | None = None) -> None:
        """Refused or failed before reaching a token: the HTTP status the client got, and the
        field it asked for that this server does not honour, if that was why."""
        outcome = f"http_{status}"
        self._failure.labels(self.model_name, outcome).inc()
        if refused_field in KNOWN_FIELDS:  # a label from a known set only: a client cannot grow it
            self._refused_fields.labels(self.model_name, refused_field).inc()
        self.outcomes[outcome] += 1
        if self.slo_window is not None and status >= 500:  # refused for want of room: a miss of both SLOs
            self.slo_window.request_ended(False)

    # --- reading -----------------------------------------------------------------------------
    def exposition(self) -> tuple[bytes, str]:
        """(body, content type) of a Prometheus scrape."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def snapshot(self) -> dict:
        medians = {f"{name}_median_s": statistics.median(v) if v else None for name, v in self.recent.items()}
        return {**medians, "outcomes": dict(self.outcomes)}


# (metric, report field, help); every one labelled by pool and replica
_REPLICA_GAUGES = (
    ("pdserve:num_requests_running", "num_running", "Requests in the replica's running batch."),
    ("pdserve:num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
    (
        "pdserve:kv_tickets_outstanding",
        None,
        "Hand-offs open: decode, blocks reserved for KV still arriving; prefill, KV on the wire.",
    ),
    ("pdserve:kv_reservation_queue_length", "num_waiting_for_blocks", "Reservations waiting for free KV blocks."),
    ("pdserve:kv_cache_usage_perc", None, "Share of KV blocks in use (1 = full)."),
)
_REPLICA_COUNTERS = (
    ("pdserve:prefix_cache_queries", "prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache."),
    ("pdserve:prefix_cache_hits", "prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache."),
    ("pdserve:num_preemptions", "num_preemptions", "Requests preempted for KV blocks."),
    ("pdserve:kv_lease_expirations", "num_kv_lease_expirations", "KV hand-offs whose lease ran out."),
    ("pdserve:prefills_expired", "num_prefills_expired", "Prompts a prefill replica dropped uncomputed: lease over."),
    ("pdserve:kv_pushes_cancelled", "num_kv_pushes_cancelled", "KV pushes cut off mid-prompt: aborted, preempted."),
    ("pdserve:kv_transfer_failures", "num_kv_transfer_failures", "KV hand-offs that failed, for any reason."),
    ("pdserve:engine_steps", "num_steps", "Forward passes the replica ran."),
    (
        "pdserve:engine_steps_ahead",
        "num_steps_ahead",
        "Of those, queued before the step before them was read (async scheduling; near all on a busy GPU).",
    ),
    ("pdserve:grammar_compiles", "num_grammar_compiles", "Output constraints compiled (grammar cache misses)."),
    ("pdserve:grammar_compile_seconds", "grammar_compile_seconds", "Seconds spent compiling output constraints."),
    ("pdserve:grammar_cache_hits", "num_grammar_cache_hits", "Output constraints served from the grammar cache."),
    ("pdserve:constrained_tokens", "num_constrained_tokens", "Tokens sampled under an output constraint's mask."),
    ("pdserve:constraint_dead_ends", "num_constraint_dead_ends", "Requests a constraint stopped at a dead end."),
)


class ReplicaReportCollector(Collector):
    """The pool replicas' last reports as gauges and counters, read when Prometheus scrapes."""

    def __init__(self, reports: Callable[[], dict[str, list[dict]]]) -> None:
        self.reports = reports

    def describe(self) -> list[Metric]:
        return []  # known only at scrape time; prometheus_client then skips the duplicate check

    def collect(self) -> Iterator[Metric]:
        rows = [(pool, report) for pool, reports in self.reports().items() for report in reports]
        for name, key, doc in _REPLICA_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=("pool", "replica"))
            for pool, report in rows:
                family.add_metric((pool, str(report.get("replica_id", ""))), _gauge_value(key, name, report))
            yield family
        for name, key, doc in _REPLICA_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=("pool", "replica"))
            for pool, report in rows:
                family.add_metric((pool, str(report.get("replica_id", ""))), float(report.get(key, 0) or 0))
            yield family


def _gauge_value(key: str | None, name: str, report: dict) -> float:
    if name == "pdserve:kv_cache_usage_perc":
        total = report.get("num_kv_blocks_total", 0) or 0
        return 0.0 if not total else 1.0 - (report.get("num_kv_blocks_free", 0) or 0) / total
    if name == "pdserve:kv_tickets_outstanding":
        return float(report.get("num_reserved", 0) or 0) + float(report.get("num_handoff", 0) or 0)
    assert key is not None
    return float(report.get(key, 0) or 0)
