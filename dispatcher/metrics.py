"""Prometheus metrics with Triton's names, served from the dispatcher's own event loop.

Hot-path cost is a few list-element increments per reply (no locks: one thread). Nothing is
rendered until a scrape: then ``render`` writes those plain counters, and the scrape-time state
the dispatcher passes to it (pending requests, decisions, learned curves, lambda), as the text
exposition (format 0.0.4, label values escaped as it requires). A render runs on the
dispatcher's one thread, so its text is re-used while nothing it shows has changed, and a scrape
storm gets the last text once rendering has had its share of the thread (RENDER_SHARE). The HTTP
server is a minimal asyncio protocol on the same loop (GET /metrics), so the decision process
gets no extra thread.

Names and types follow Triton where the meaning is the same (dashboards keep working):
nv_inference_request_success, nv_inference_request_failure{reason}, nv_inference_count,
nv_inference_exec_count, nv_inference_queue_duration_us, nv_inference_compute_infer_duration_us,
nv_inference_request_duration_us (counters, as in Triton: cumulative, named without
``_total``), and nv_inference_pending_request_count (gauge); labels model and version (always
"1", as the front door serves every model), and Batchyard's path and priority. A failure's
``reason`` is one of Triton 2.51's four (REJECTED: queue full or timeout expired; CANCELED;
BACKEND: the model or its worker failed; OTHER: the request itself, e.g. a wrong shape or an
unknown model), and its ``status`` Batchyard's status name, which says more.
nv_inference_compute_input_duration_us and ..._output_... are 0: a batch's input and output
copies count in its compute time (as in the front door's statistics), and a Triton dashboard
that adds the three still finds all three.
Batchyard's own: batchyard_request_latency_seconds (histogram), batchyard_decisions_total{reason},
batchyard_unknown_model_requests_total (no model label: the names are the clients'),
batchyard_inflight_request_count{model} (beside Triton's pending count, which excludes them),
batchyard_cost_launch_us / batchyard_cost_per_item_us {model,path}, batchyard_path_simulated{model,path}
(1 where that curve's timings came from a simulated device), batchyard_arrival_rate{model};
LLM mode's decisions in batchyard_decisions_total as reason="llm_<route>" (as `batchyard status`
shows them) and its curves in batchyard_llm_cost_launch_us / _per_item_us / _per_item_squared_us
{model,curve}. An LLM model's path label is its request's route (prefill-cpu or gpu).
"""

from __future__ import annotations

import asyncio
import bisect
import copy
import math
import time
from typing import Callable, NamedTuple

from .addresses import asyncio_listen_host
from .protocol import PRIORITY_NAMES, Status

# Triton 2.51 labels a failure with one of four reasons (its MetricModelReporter's
# failure_reasons_map); a dashboard's {reason="REJECTED"} must find the same requests here. A
# status not named is the request's own fault: OTHER.
TRITON_REASONS = {Status.OVERLOADED: "REJECTED", Status.DEADLINE_EXCEEDED: "REJECTED", Status.CANCELLED: "CANCELED",
                  Status.INTERNAL: "BACKEND", Status.UNAVAILABLE: "BACKEND"}

LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_OK, _ITEMS, _QUEUE, _COMPUTE, _TOTAL = range(5)
# Families from the per-(model, path, priority) rows of Metrics.ok: (name, row index, help).
# Counters, as Triton declares them, under Triton's names without ``_total``: valid in the text
# format 0.0.4, which is what is served (Prometheus stores them under these names). A parser that
# reads them as OpenMetrics, prometheus_client's, names their samples ``<name>_total``; the bench's
# scrape (bench/harness.py: exposition_samples) gives them back their names as written.
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
    llm_curves: dict  # LLM model -> llm_fit.LearnedCurves.describe()


# At most this share of the dispatcher's time goes to rendering, however often it is scraped: a
# scrape that comes while the share is spent gets the last text (at most ~10 renders' time old).
# The credit refills at RENDER_SHARE seconds a second, up to RENDER_CREDIT_S, so scrapes that
# come seconds apart (Prometheus every 15 s, a test, a person) are always rendered fresh.
RENDER_SHARE = 0.1
RENDER_CREDIT_S = 0.05


class Metrics:
    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 cpu_clock: Callable[[], float] = time.thread_time) -> None:
        """``clock`` refills the render share, ``cpu_clock`` measures what a render spends of it:
        the thread's CPU time, so a render the host preempted is not charged for the wait (on a
        loaded host one was, and the next scrapes got stale text). A test gives clocks it steps."""
        self._clock, self._cpu_clock = clock, cpu_clock
        self.ok: dict[tuple[str, str, int], list] = {}  # (model, path, prio) -> [n, items, queue, compute, total]
        self.failures: dict[tuple[str, int, int], int] = {}  # (model, status, prio) -> n
        self.exec_count: dict[tuple[str, str], int] = {}  # (model, path) -> batches
        self.latency: dict[str, list] = {}  # model -> bucket counts (+Inf last), then [sum]
        self.unknown_model_requests = 0  # one number: names asked for are the client's, without end
        self.changes = 0  # every count adds one: a scrape finding it and its state unchanged re-uses the text
        self._text = ""
        self._text_of: tuple | None = None  # (changes, ScrapeState) the text shows
        self._credit_s = RENDER_CREDIT_S
        self._credit_at = clock()
        self._labels: dict[tuple, str] = {}  # series key -> its escaped label text (made once)

    # ---------------------------------------------------------------- hot path
    def request_ok(self, model: str, path: str, prio: int, items: int, queue_us: int, compute_us: int,
                   total_us: int) -> None:
        self.changes += 1
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

    def request_failed(self, model: str, status: int, prio: int) -> None:
        """``prio``: the class the client asked for, as a success's (a per-class error ratio was no
        query: failures had no priority label)."""
        self.changes += 1
        key = (model, int(status), prio)
        self.failures[key] = self.failures.get(key, 0) + 1

    def unknown_model(self) -> None:
        self.changes += 1
        self.unknown_model_requests += 1

    def model_served(self, model: str, path: str = "") -> None:
        """A model now known (at start), or served on ``path`` (a worker registered): its series
        exist from now, at 0, as Triton creates a model's counters when it loads. Born at their
        first increment, a failure series appeared already at its burst's count (14), and
        Prometheus' rate() and increase() read that burst as 0."""
        self.changes += 1
        for status in Status:
            if status not in (Status.OK, Status.UNKNOWN_MODEL):  # (an unknown model has no series)
                for prio in range(len(PRIORITY_NAMES)):
                    self.failures.setdefault((model, int(status), prio), 0)
        self.latency.setdefault(model, [0] * (len(LATENCY_BUCKETS_S) + 2))
        if path:
            for prio in range(len(PRIORITY_NAMES)):
                self.ok.setdefault((model, path, prio), [0, 0, 0, 0, 0])
            self.exec_count.setdefault((model, path), 0)

    def batch_done(self, model: str, path: str) -> None:
        self.changes += 1
        key = (model, path)
        self.exec_count[key] = self.exec_count.get(key, 0) + 1

    # ---------------------------------------------------------------- exposition
    def render(self, pending: dict[str, int], decisions: dict[str, int], curves: dict, rates: dict[str, float],
               in_flight: dict[str, int] | None = None, llm_curves: dict | None = None) -> str:
        """The Prometheus text exposition (format 0.0.4) of the counters and the given scrape-time
        state: the last text again when nothing it shows has changed, or while rendering has had
        its share of the thread (RENDER_SHARE)."""
        return self.render_from(lambda: (pending, decisions, curves, rates, in_flight, llm_curves))

    def render_from(self, state_of: Callable[[], tuple]) -> str:
        """``render`` of the parts ``state_of`` gives, asked only when the text may be written
        again: while the share is spent the last text goes out at once. Gathering and comparing
        the state count in the share too: at 100 models they took ~1.4 ms a scrape uncharged,
        and a storm of scrapes of an unchanged text took half of the thread (an outside review)."""
        now = self._clock()
        self._credit_s = min(RENDER_CREDIT_S, self._credit_s + (now - self._credit_at) * RENDER_SHARE)
        self._credit_at = now
        if self._text_of is not None and self._credit_s <= 0:
            return self._text
        cpu = self._cpu_clock()
        pending, decisions, curves, rates, in_flight, llm_curves = state_of()
        state = ScrapeState(pending, decisions, curves, rates, in_flight or {}, llm_curves or {})
        if self._text_of != (self.changes, state):
            self._text = self._write(state)
            # A copy, nested values too: a caller that fills the same dicts again, or changes a
            # curve's own dict, must not make the old text look current.
            self._text_of = (self.changes, copy.deepcopy(state))
        self._credit_s -= self._cpu_clock() - cpu
        self._credit_at = self._clock()
        return self._text

    def _label(self, key: tuple, make: Callable[[], str]) -> str:
        text = self._labels.get(key)
        if text is None:
            text = self._labels[key] = make()
        return text

    def _write(self, s: ScrapeState) -> str:
        """The text, written directly: prometheus_client's generate_latest took ~5 us a sample
        (validating and escaping each label of each sample), 33 ms a scrape at 100 models. Label
        texts are escaped once per series, and a sample is one f-string."""
        out: list[str] = []
        w = out.append
        ok_rows = sorted(self.ok.items())
        ok_labels = [self._label(("ok", *key), lambda key=key: _ok_labels(*key)) for key, _ in ok_rows]
        for name, idx, help_ in _TRITON_OK_FAMILIES:
            w(_head(name, help_, "counter"))
            if idx is None:
                w("".join([f"{name}{{{lab}}} 0\n" for lab in ok_labels]))
            else:
                w("".join([f"{name}{{{lab}}} {row[idx]}\n" for lab, (_, row) in zip(ok_labels, ok_rows)]))
        name = "nv_inference_request_failure"
        w(_head(name, "Failed inference requests by reason", "counter"))
        for (model, status, prio), n in sorted(self.failures.items()):
            lab = self._label(("fail", model, status, prio), lambda: _failure_labels(model, status, prio))
            w(f"{name}{{{lab}}} {n}\n")
        name = "nv_inference_exec_count"
        w(_head(name, "Batches executed", "counter"))
        for (model, path), n in sorted(self.exec_count.items()):
            w(f'{name}{{model="{_esc(model)}",path="{_esc(path)}",version="{VERSION}"}} {n}\n')
        _gauge(w, "nv_inference_pending_request_count", "Requests queued, not yet given to a worker",
               ((f'model="{_esc(k)}",version="{VERSION}"', n) for k, n in sorted(s.pending.items())))
        _gauge(w, "batchyard_inflight_request_count", "Requests given to a worker and not yet answered",
               ((f'model="{_esc(k)}"', n) for k, n in sorted(s.in_flight.items())))

        name = "batchyard_request_latency_seconds"
        w(_head(name, "Arrival-to-reply latency in the dispatcher", "histogram"))
        for model, h in sorted(self.latency.items()):
            lab, cum = _esc(model), 0
            for le, n in zip(_LES, h[:-1]):
                cum += n
                w(f'{name}_bucket{{le="{le}",model="{lab}"}} {cum}\n')
            w(f'{name}_count{{model="{lab}"}} {cum}\n{name}_sum{{model="{lab}"}} {_num(h[-1] / 1e6)}\n')
        name = "batchyard_unknown_model_requests_total"
        w(_head(name, "Inferences and model lookups naming a model this dispatcher does not serve", "counter"))
        w(f"{name} {self.unknown_model_requests}\n")
        name = "batchyard_decisions_total"
        w(_head(name, "Policy decisions by reason (LLM mode's: llm_<route>)", "counter"))
        for reason, n in sorted(s.decisions.items()):
            w(f'{name}{{reason="{_esc(reason)}"}} {_num(n)}\n')

        curves = sorted((tuple(k.rsplit("/", 1)), v) for k, v in s.curves.items())  # a model may hold "/"
        curve_labels = [f'model="{_esc(m)}",path="{_esc(p)}"' for (m, p), _ in curves]
        _gauge(w, "batchyard_cost_launch_us", "Learned launch cost of T(B) = launch + per_item*B",
               ((lab, v["launch_us"]) for lab, (_, v) in zip(curve_labels, curves)))
        _gauge(w, "batchyard_cost_per_item_us", "Learned per-item cost of T(B)",
               ((lab, v["per_item_us"]) for lab, (_, v) in zip(curve_labels, curves)))
        # Simulated timings are labelled as such (DESIGN.md), but not by a label on the Triton
        # families: dashboards key on their label sets. One series per (model, path), the key
        # those families and the curves share, so a query can join on(model, path) to keep or
        # drop the simulated paths; a per-worker series would need a worker -> path map to join.
        _gauge(w, "batchyard_path_simulated", "1: a simulated device serves this model's path, or its profile "
               "was measured on one: its timings are not real hardware's",
               ((lab, int(bool(v.get("simulated")))) for lab, (_, v) in zip(curve_labels, curves)))
        _gauge(w, "batchyard_arrival_rate", "Estimated arrival rate lambda(t), items/s (a request of B items counts B)",
               ((f'model="{_esc(k)}"', r) for k, r in sorted(s.rates.items())))
        self._write_llm_curves(w, s.llm_curves)
        return "".join(out)

    @staticmethod
    def _write_llm_curves(w: Callable[[str], None], llm_curves: dict) -> None:
        """LLM mode's learned curves (llm_fit.LearnedCurves.describe(), seconds) in us, by model
        and curve: cpu_prefill and gpu_prefill are launch + per_item*tokens +
        per_item_squared*tokens^2 of a step's prompts, gpu_decode launch + per_item*streams of a
        step, kv launch + per_item*tokens of a KV move."""
        rows = [(f'curve="{_esc(c)}",model="{_esc(m)}"', fit["coef"])
                for m, by_curve in sorted(llm_curves.items()) for c, fit in sorted(by_curve.items())]
        for name, term, help_ in _LLM_COST_FAMILIES:
            _gauge(w, name, help_, ((lab, coef[term] * 1e6) for lab, coef in rows if len(coef) > term))


_LES = [repr(le) for le in LATENCY_BUCKETS_S] + ["+Inf"]  # as Go writes them: "0.0005", "1.0"
# (name, coefficient, help) of the LLM curves: coefficient 0 is the constant term, 1 the linear one.
_LLM_COST_FAMILIES = (
    ("batchyard_llm_cost_launch_us", 0, "Learned constant cost of an LLM model's curve"),
    ("batchyard_llm_cost_per_item_us", 1, "Learned cost per prompt token (prefill, kv) or running stream (decode)"),
    ("batchyard_llm_cost_per_item_squared_us", 2, "Learned cost per prompt token squared of a prefill (attention)"),
)


def _ok_labels(model: str, path: str, prio: int) -> str:
    return f'model="{_esc(model)}",path="{_esc(path)}",priority="{PRIORITY_NAMES[prio]}",version="{VERSION}"'


def _failure_labels(model: str, status: int, prio: int) -> str:
    reason = TRITON_REASONS.get(status, "OTHER")
    return (f'model="{_esc(model)}",priority="{PRIORITY_NAMES[prio]}",reason="{reason}",status="{status_name(status)}",'
            f'version="{VERSION}"')


def _esc(value: str) -> str:
    """A label value as the text format writes it: backslash, double quote and newline escaped."""
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return value


def _num(value) -> str:
    if type(value) is int:
        return str(value)
    value = float(value)
    if math.isfinite(value):
        return repr(value)
    return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")


def _head(name: str, help_: str, kind: str) -> str:
    return f"# HELP {name} {help_}\n# TYPE {name} {kind}\n"


def _gauge(w: Callable[[str], None], name: str, help_: str, rows) -> None:
    w(_head(name, help_, "gauge"))
    for labels, value in rows:
        w(f"{name}{{{labels}}} {_num(value)}\n")


# The endpoint shares the dispatcher's thread and file-descriptor table: a peer that connects and
# never finishes its request must not keep a descriptor for good. Thousands of such connections
# were all kept, each an fd the dispatcher's sockets then lacked.
METRICS_MAX_CONNECTIONS = 32  # open at once; a new one closes the oldest, so a scrape gets through
METRICS_IDLE_S = 10.0  # a request not complete by then is dropped
CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"  # the text format's, as prometheus_client names it


class _MetricsHTTP(asyncio.Protocol):
    """Just enough HTTP/1.1: GET (or HEAD) /metrics -> 200 text, anything else -> 404; then close."""

    def __init__(self, render: Callable[[], str], open_now: dict, encoded: list):
        self.render = render
        self.encoded = encoded  # [text, its bytes]: the server's last, encoded once (562 KB at 100 models)
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
        # HEAD as GET without the body (a probe's; it was a 404 beside GET's 200)
        if len(line) >= 2 and line[0] in (b"GET", b"HEAD") and line[1].split(b"?")[0] == b"/metrics":
            text = self.render()
            if text is not self.encoded[0]:
                self.encoded[:] = [text, text.encode()]
            body, status, ctype = self.encoded[1], b"200 OK", CONTENT_TYPE
        else:
            body, status, ctype = b"not found; try /metrics\n", b"404 Not Found", b"text/plain"
        self.transport.writelines([b"HTTP/1.1 " + status + b"\r\nContent-Type: " + ctype + b"\r\nContent-Length: "
                                   + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n",
                                   b"" if line[:1] == [b"HEAD"] else body])
        self.transport.close()


async def serve_metrics(loop: asyncio.AbstractEventLoop, host: str, port: int, render: Callable[[], str]):
    open_now: dict = {}
    encoded: list = [None, b""]
    return await loop.create_server(lambda: _MetricsHTTP(render, open_now, encoded), asyncio_listen_host(host), port)
