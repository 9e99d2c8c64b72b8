"""Prometheus metrics with Triton's names, served from the dispatcher's own event loop.

Hot-path cost is a few list-element increments per reply (no locks: one thread); the text
exposition is rendered only when scraped. The HTTP server is a minimal asyncio protocol on the
same loop (GET /metrics), so the decision process gets no extra thread.

Names follow Triton where the meaning is the same (dashboards keep working):
nv_inference_request_success, nv_inference_request_failure{reason}, nv_inference_count,
nv_inference_exec_count, nv_inference_queue_duration_us, nv_inference_compute_infer_duration_us,
nv_inference_request_duration_us (cumulative counters, as in Triton), and
nv_inference_pending_request_count (gauge); labels model, path, priority.
Batchyard's own: batchyard_request_latency_seconds (histogram), batchyard_decisions_total{reason},
batchyard_cost_launch_us / batchyard_cost_per_item_us {model,path}, batchyard_arrival_rate{model}.
"""

from __future__ import annotations

import asyncio
import bisect
from typing import Callable

from .protocol import PRIORITY_NAMES

LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_OK, _ITEMS, _QUEUE, _COMPUTE, _TOTAL = range(5)


class Metrics:
    def __init__(self) -> None:
        self.ok: dict[tuple[str, str, int], list] = {}  # (model, path, prio) -> [n, items, queue, compute, total]
        self.failures: dict[tuple[str, str], int] = {}  # (model, reason) -> n
        self.exec_count: dict[tuple[str, str], int] = {}  # (model, path) -> batches
        self.latency: dict[str, list] = {}  # model -> bucket counts (+Inf last), then [sum]

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

    def request_failed(self, model: str, reason: str) -> None:
        key = (model, reason)
        self.failures[key] = self.failures.get(key, 0) + 1

    def batch_done(self, model: str, path: str) -> None:
        key = (model, path)
        self.exec_count[key] = self.exec_count.get(key, 0) + 1

    # ---------------------------------------------------------------- exposition
    def render(self, pending: dict[str, int], decisions: dict[str, int], curves: dict, rates: dict[str, float]) -> str:
        out: list[str] = []

        def family(name: str, kind: str, help_: str, rows) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            for labels, value in rows:
                lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
                out.append(f"{name}{{{lab}}} {value}")

        def ok_rows(idx):
            return [({"model": m, "path": p, "priority": PRIORITY_NAMES[pr]}, row[idx])
                    for (m, p, pr), row in sorted(self.ok.items())]

        family("nv_inference_request_success", "counter", "Successful inference requests", ok_rows(_OK))
        family("nv_inference_request_failure", "counter", "Failed inference requests by reason",
               [({"model": m, "reason": r}, n) for (m, r), n in sorted(self.failures.items())])
        family("nv_inference_count", "counter", "Inferences performed (batch items)", ok_rows(_ITEMS))
        family("nv_inference_exec_count", "counter", "Batches executed",
               [({"model": m, "path": p}, n) for (m, p), n in sorted(self.exec_count.items())])
        family("nv_inference_queue_duration_us", "counter", "Cumulative queue time, us", ok_rows(_QUEUE))
        family("nv_inference_compute_infer_duration_us", "counter", "Cumulative compute time of the batches "
               "requests ran in, us", ok_rows(_COMPUTE))
        family("nv_inference_request_duration_us", "counter", "Cumulative end-to-end time in the dispatcher, us",
               ok_rows(_TOTAL))
        family("nv_inference_pending_request_count", "gauge", "Requests queued or in flight",
               [({"model": m}, n) for m, n in sorted(pending.items())])
        out.append("# HELP batchyard_request_latency_seconds Arrival-to-reply latency in the dispatcher")
        out.append("# TYPE batchyard_request_latency_seconds histogram")
        for m, h in sorted(self.latency.items()):
            cum = 0
            for le, n in zip((*LATENCY_BUCKETS_S, "+Inf"), h[:-1]):
                cum += n
                out.append(f'batchyard_request_latency_seconds_bucket{{model="{m}",le="{le}"}} {cum}')
            out.append(f'batchyard_request_latency_seconds_sum{{model="{m}"}} {h[-1] / 1e6}')
            out.append(f'batchyard_request_latency_seconds_count{{model="{m}"}} {cum}')
        family("batchyard_decisions_total", "counter", "Policy decisions by reason",
               [({"reason": r}, n) for r, n in sorted(decisions.items())])
        family("batchyard_cost_launch_us", "gauge", "Learned launch cost of T(B) = launch + per_item*B",
               [({"model": k.split("/")[0], "path": k.split("/")[1]}, v["launch_us"]) for k, v in sorted(curves.items())])
        family("batchyard_cost_per_item_us", "gauge", "Learned per-item cost of T(B)",
               [({"model": k.split("/")[0], "path": k.split("/")[1]}, v["per_item_us"]) for k, v in sorted(curves.items())])
        family("batchyard_arrival_rate", "gauge", "Estimated arrival rate lambda(t), requests/s",
               [({"model": m}, r) for m, r in sorted(rates.items())])
        return "\n".join(out) + "\n"


class _MetricsHTTP(asyncio.Protocol):
    """Just enough HTTP/1.1: GET /metrics -> 200 text, anything else -> 404; then close."""

    def __init__(self, render: Callable[[], str]):
        self.render = render
        self.buf = b""

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if b"\r\n\r\n" not in self.buf and len(self.buf) < 8192:
            return
        line = self.buf.split(b"\r\n", 1)[0].split()
        if len(line) >= 2 and line[0] == b"GET" and line[1].split(b"?")[0] == b"/metrics":
            body, status = self.render().encode(), b"200 OK"
            ctype = b"text/plain; version=0.0.4; charset=utf-8"
        else:
            body, status, ctype = b"not found; try /metrics\n", b"404 Not Found", b"text/plain"
        self.transport.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: " + ctype + b"\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
        self.transport.close()


async def serve_metrics(loop: asyncio.AbstractEventLoop, host: str, port: int, render: Callable[[], str]):
    return await loop.create_server(lambda: _MetricsHTTP(render), host, port)
