"""Prometheus metrics with Triton's names, served from the dispatcher's own event loop.

Hot-path cost is a few list-element increments per reply (no locks: one thread). Nothing is
rendered until a scrape: then a ``prometheus_client`` collector turns those plain counters, and
the scrape-time state the dispatcher passes to ``render`` (pending requests, decisions, learned
curves, lambda), into metric families, and ``generate_latest`` writes the text exposition
(label values escaped as the format requires). The HTTP server is a minimal asyncio protocol on
the same loop (GET /metrics), so the decision process gets no extra thread.

Names follow Triton where the meaning is the same (dashboards keep working):
nv_inference_request_success, nv_inference_request_failure{reason}, nv_inference_count,
nv_inference_exec_count, nv_inference_queue_duration_us, nv_inference_compute_infer_duration_us,
nv_inference_request_duration_us (cumulative, as in Triton), and
nv_inference_pending_request_count (gauge); labels model and version (always "1", as the front
door serves every model), and Batchyard's path and priority. A failure's ``reason`` is one of Triton
2.51's four (REJECTED: queue full or timeout expired; CANCELED; BACKEND: the model or its worker
failed; OTHER: the request itself, e.g. a wrong shape or an unknown model), and its ``status``
Batchyard's status name, which says more. nv_inference_compute_input_duration_us
and ..._output_... are 0: a batch's input and output copies count in its compute time (as in the
front door's statistics), and a Triton dashboard that adds the three still finds all three.
Batchyard's own: batchyard_request_latency_seconds (histogram), batchyard_decisions_total{reason},
batchyard_unknown_model_requests_total (no model label: the names are the clients'),
batchyard_inflight_request_count{model} (beside Triton's pending count, which excludes them),
batchyard_cost_launch_us / batchyard_cost_per_item_us {model,path}, batchyard_arrival_rate{model}.

prometheus_client is imported by ``serve_metrics`` (at start-up) or the first ``render``, never at
import: it costs ~0.1 s, which a dispatcher without metrics should not pay.
"""

from __future__ import annotations

import asyncio
import bisect
from typing import Callable, Iterator, NamedTuple

from .protocol import PRIORITY_NAMES, Status

# Triton 2.51 labels a failure with one of four reasons (its MetricModelReporter's
# failure_reasons_map); a dashboard's {reason="REJECTED"} must find the same requests here. A
# status not named is the request's own fault: OTHER.
TRITON_REASONS = {Status.OVERLOADED: "REJECTED", Status.DEADLINE_EXCEEDED: "REJECTED", Status.CANCELLED: "CANCELED",
                  Status.INTERNAL: "BACKEND", Status.UNAVAILABLE: "BACKEND"}

LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_OK, _ITEMS, _QUEUE, _COMPUTE, _TOTAL = range(5)
# Families from the per-(model, path, priority) rows of Metrics.ok: (name, row index, help).
_TRITON_OK_FAMILIES = (
    ("nv_inference_request_success", _OK, "Successful inference requests"),
    ("nv_inference_count", _ITEMS, "Inferences performed (batch items)"),
    ("nv_inference_queue_duration_us", _QUEUE, "Cumulative queue time, us"),
    ("nv_inference_compute_infer_duration_us", _COMPUTE, "Cumulative compute time of the batches requests ran in, us"),
    ("nv_inference_request_duration_us", _TOTAL, "Cumulative end-to-end time in the dispatcher, us"),
    ("nv_inference_compute_input_duration_us", None, "Cumulative input time, us (0: counted in compute_infer)"),
    ("nv_inference_compute_output_duration_us", None, "Cumulative output time, us (0: counted in compute_infer)"),
)
VERSION = "1"  # the one version of every model (the front door's, and Triton's label)


def status_name(status: int) -> str:
    return Status(status).name.lower() if status in Status._value2member_map_ else f"status_{status}"


class ScrapeState(NamedTuple):
    """What the dispatcher knows only at scrape time (computed by it, not counted here)."""
    pending: dict  # model -> requests queued, not yet in a batch (Triton's meaning)
    decisions: dict  # reason -> policy decisions
    curves: dict  # "model/path" -> {"launch_us", "per_item_us", ...}
    rates: dict  # model -> estimated arrival rate, items/s (what the policies plan with)
    in_flight: dict  # model -> requests given to a worker and not yet answered


class Metrics:
    def __init__(self) -> None:
        self.ok: dict[tuple[str, str, int], list] = {}  # (model, path, prio) -> [n, items, queue, compute, total]
        self.failures: dict[tuple[str, int], int] = {}  # (model, status) -> n
        self.exec_count: dict[tuple[str, str], int] = {}  # (model, path) -> batches
        self.latency: dict[str, list] = {}  # model -> bucket counts (+Inf last), then [sum]
        self.unknown_model_requests = 0  # one number: names asked for are the client's, without end
        self._collector = DispatcherCollector(self)
        self._registry = None  # a private CollectorRegistry, made at the first render

    # ---------------------------------------------------------------- hot path
    def request_ok(self, model: str, path: str, prio: int, items: int, queue_us: int, compute_us: int,
                   total_us: int) -> None:
        key = (model, path, prio)
        row = self.ok.get(key)
        if row is None:
            row = self.ok[key] = [0, 0, 0, 0, 0]
        row[_OK] += 1
        row[_ITEMS] += items
        row[_QUEUE] += queue_us
        row[_COMPUTE] += compute_us
        row[_TOTAL] += total_us
        h = self.latency.get(model)
        if h is None:
            h = self.latency[model] = [0] * (len(LATENCY_BUCKETS_S) + 2)
        h[bisect.bisect_left(LATENCY_BUCKETS_S, total_us * 1e-6)] += 1
        h[-1] += total_us

    def request_failed(self, model: str, status: int) -> None:
        key = (model, int(status))
        self.failures[key] = self.failures.get(key, 0) + 1

    def unknown_model(self) -> None:
        self.unknown_model_requests += 1

    def model_served(self, model: str, path: str = "") -> None:
        """A model now known (at start), or served on ``path`` (a worker registered): its series
        exist from now, at 0, as Triton creates a model's counters when it loads. Born at their
        first increment, a failure series appeared already at its burst's count (14), and
        Prometheus' rate() and increase() read that burst as 0."""
        for status in Status:
            if status not in (Status.OK, Status.UNKNOWN_MODEL):  # (an unknown model has no series)
                self.failures.setdefault((model, int(status)), 0)
        self.latency.setdefault(model, [0] * (len(LATENCY_BUCKETS_S) + 2))
        if path:
            for prio in range(len(PRIORITY_NAMES)):
                self.ok.setdefault((model, path, prio), [0, 0, 0, 0, 0])
            self.exec_count.setdefault((model, path), 0)

    def batch_done(self, model: str, path: str) -> None:
        key = (model, path)
        self.exec_count[key] = self.exec_count.get(key, 0) + 1

    # ---------------------------------------------------------------- exposition
    def render(self, pending: dict[str, int], decisions: dict[str, int], curves: dict, rates: dict[str, float],
               in_flight: dict[str, int] | None = None) -> str:
        """The Prometheus text exposition (format 0.0.4) of the counters and the given scrape-time state."""
        from prometheus_client.exposition import generate_latest

        if self._registry is None:
            from prometheus_client.registry import CollectorRegistry

            self._registry = CollectorRegistry()
            self._registry.register(self._collector)
        # One thread: the state set here is the state the collector reads during generate_latest.
        self._collector.scrape = ScrapeState(pending, decisions, curves, rates, in_flight or {})
        return generate_latest(self._registry).decode()


class DispatcherCollector:
    """A ``prometheus_client.registry.Collector`` over Metrics' plain counters and the scrape state.

    Triton's cumulative counters are exposed as *untyped* families: prometheus_client writes a
    counter's samples as ``<name>_total``, which would rename ``nv_inference_request_success`` and
    break dashboards written for Triton. Untyped keeps the exact names; Prometheus applies rate()
    to them all the same. Batchyard's own counter is a real counter (``batchyard_decisions_total``).
    """

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.scrape = ScrapeState({}, {}, {}, {}, {})

    def collect(self) -> Iterator:
        from prometheus_client.metrics_core import (CounterMetricFamily, GaugeMetricFamily,
                                                    HistogramMetricFamily, UnknownMetricFamily)
        from prometheus_client.utils import floatToGoString

        def gauge(name: str, help_: str, labels: tuple, rows) -> GaugeMetricFamily:
            fam = GaugeMetricFamily(name, help_, labels=labels)
            for key, value in rows:
                fam.add_metric(key, value)
            return fam

        m, s = self.metrics, self.scrape
        ok_rows = sorted(m.ok.items())
        for name, idx, help_ in _TRITON_OK_FAMILIES:
            fam = UnknownMetricFamily(name, help_, labels=("model", "version", "path", "priority"))
            for (model, path, prio), row in ok_rows:
                fam.add_metric((model, VERSION, path, PRIORITY_NAMES[prio]), 0 if idx is None else row[idx])
            yield fam
        fam = UnknownMetricFamily("nv_inference_request_failure", "Failed inference requests by reason",
                                  labels=("model", "version", "reason", "status"))
        for (model, status), n in sorted(m.failures.items()):
            fam.add_metric((model, VERSION, TRITON_REASONS.get(status, "OTHER"), status_name(status)), n)
        yield fam
        fam = UnknownMetricFamily("nv_inference_exec_count", "Batches executed", labels=("model", "version", "path"))
        for (model, path), n in sorted(m.exec_count.items()):
            fam.add_metric((model, VERSION, path), n)
        yield fam
        yield gauge("nv_inference_pending_request_count", "Requests queued, not yet given to a worker",
                     ("model", "version"), (((k, VERSION), n) for k, n in sorted(s.pending.items())))
        yield gauge("batchyard_inflight_request_count", "Requests given to a worker and not yet answered",
                     ("model",), (((k,), n) for k, n in sorted(s.in_flight.items())))

        fam = HistogramMetricFamily("batchyard_request_latency_seconds", "Arrival-to-reply latency in the dispatcher",
                                    labels=("model",))
        les = [floatToGoString(le) for le in LATENCY_BUCKETS_S] + ["+Inf"]
        for model, h in sorted(m.latency.items()):
            cum, buckets = 0, []
            for le, n in zip(les, h[:-1]):
                cum += n
                buckets.append((le, cum))
            fam.add_metric((model,), buckets, sum_value=h[-1] / 1e6)
        yield fam
        yield CounterMetricFamily("batchyard_unknown_model_requests",
                                  "Inferences and model lookups naming a model this dispatcher does not serve",
                                  value=m.unknown_model_requests)
        fam = CounterMetricFamily("batchyard_decisions", "Policy decisions by reason", labels=("reason",))
        for reason, n in sorted(s.decisions.items()):
            fam.add_metric((reason,), n)
        yield fam
        curves = sorted((tuple(k.rsplit("/", 1)), v) for k, v in s.curves.items())  # a model may hold "/"
        yield gauge("batchyard_cost_launch_us", "Learned launch cost of T(B) = launch + per_item*B",
                     ("model", "path"), ((k, v["launch_us"]) for k, v in curves))
        yield gauge("batchyard_cost_per_item_us", "Learned per-item cost of T(B)",
                     ("model", "path"), ((k, v["per_item_us"]) for k, v in curves))
        yield gauge("batchyard_arrival_rate", "Estimated arrival rate lambda(t), items/s (a request of B items counts B)",
                     ("model",), (((k,), r) for k, r in sorted(s.rates.items())))


# The endpoint shares the dispatcher's thread and file-descriptor table: a peer that connects and
# never finishes its request must not keep a descriptor for good. Thousands of such connections
# were all kept, each an fd the dispatcher's sockets then lacked.
METRICS_MAX_CONNECTIONS = 32  # open at once; a new one closes the oldest, so a scrape gets through
METRICS_IDLE_S = 10.0  # a request not complete by then is dropped


class _MetricsHTTP(asyncio.Protocol):
    """Just enough HTTP/1.1: GET /metrics -> 200 text, anything else -> 404; then close."""

    def __init__(self, render: Callable[[], str], open_now: dict):
        self.render = render
        self.buf = b""
        self.open_now = open_now  # the server's open connections, oldest first (a dict as an ordered set)
        self.idle = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        if len(self.open_now) >= METRICS_MAX_CONNECTIONS:
            next(iter(self.open_now)).transport.abort()  # its connection_lost forgets it
        self.open_now[self] = None
        self.idle = asyncio.get_running_loop().call_later(METRICS_IDLE_S, transport.abort)

    def connection_lost(self, exc) -> None:
        self.open_now.pop(self, None)
        if self.idle is not None:
            self.idle.cancel()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if b"\r\n\r\n" not in self.buf and len(self.buf) < 8192:
            return
        line = self.buf.split(b"\r\n", 1)[0].split()
        if len(line) >= 2 and line[0] == b"GET" and line[1].split(b"?")[0] == b"/metrics":
            from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

            body, status, ctype = self.render().encode(), b"200 OK", CONTENT_TYPE_PLAIN_0_0_4.encode()
        else:
            body, status, ctype = b"not found; try /metrics\n", b"404 Not Found", b"text/plain"
        self.transport.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: " + ctype + b"\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
        self.transport.close()


async def serve_metrics(loop: asyncio.AbstractEventLoop, host: str, port: int, render: Callable[[], str]):
    # Import now, at start-up: done at the first scrape it would stall the decision loop ~0.1 s.
    import prometheus_client.exposition  # noqa: F401

    open_now: dict = {}
    return await loop.create_server(lambda: _MetricsHTTP(render, open_now), host, port)
