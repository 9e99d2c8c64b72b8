"""What the dispatcher says about itself: the status reply (docs/protocol.md, `status` reply)
and the Prometheus exposition's scrape-time state. Read-only views of a running Dispatcher."""

from __future__ import annotations

import math
import os
import time

from . import protocol as P
from .protocol import Status


def described_curves(d) -> dict:
    """Each learned cost curve by "model/path", with "simulated": true where a simulated worker
    serves that model on that path, or the curve's profile entry was measured on one. A path
    that simulated and real workers serve together is true: its curve has learned from the
    simulated device's timings, so its numbers are not real hardware's (a boolean, not a third
    value, so a reader and the /metrics gauge need no other case). It follows the workers
    registered now: a simulated worker that has left no longer marks the path."""
    served_simulated = {(m, w.path) for w in d.state.workers.values() if w.simulated for m in w.models}
    return {f"{m}/{p}": c.describe() | {"simulated": c.simulated or (m, p) in served_simulated}
            for (m, p), c in d.state.costs.items()}


def curves(d) -> dict:
    """Learned cost curves by "model/path" (``described_curves``). NaN is not JSON and
    MessagePack readers choke on it: an unknown value is None."""
    return {key: {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in desc.items()}
            for key, desc in described_curves(d).items()}


def llm_curves(d) -> dict:
    """LLM mode: the learned prefill, decode and KV-move curves by "model/llm"."""
    return {f"{m}/llm": c.describe() for m, c in d.llm.core.curves.items()}


def decisions(d) -> dict:
    """The policy's decisions by reason, then LLM mode's routes as llm_<route> where the node
    serves an LLM model: one set for the status reply and /metrics (the metrics had only the
    first)."""
    llm = {f"llm_{k}": v for k, v in d.llm.core.decisions.items()} if d.llm.core.models() else {}
    return dict(d.core.decisions) | llm


def status_reply(d, rid: int, brief: bool = False) -> P.StatusReply:
    workers = [P.WorkerInfo(name=w.name, pid=w.pid, path=w.path, models=list(w.models),
                            inflight=w.inflight, simulated=w.simulated)
               for w in d.state.workers.values()] + d.llm.worker_infos()
    core = d.core
    reply = P.StatusReply(v=P.PROTOCOL_VERSION, id=rid, status=Status.OK, registrations=core.registrations,
                          departures=core.departures, dispatcher_pid=os.getpid(), queued=d.state.queued_requests(),
                          workers=workers, models=sorted(d.specs) + sorted(d.llm.core.models()),
                          policy=core.policy.name)
    if not brief:  # readiness probes ask brief: the rest costs the dispatcher's thread far more
        now = time.monotonic()
        reply.curves = curves(d) | llm_curves(d)
        reply.arrival_rate = {m: round(d.state.arrival(m).rate(now), 2) for m in d.specs}
        reply.decisions = decisions(d)
        reply.decision_lateness = d.lateness.quantiles_us()
    return reply


def render_metrics(d) -> str:
    """The /metrics text: the counters, with what `status` shows of decisions and learned curves."""
    def state() -> tuple:  # (gathered only when the text may be written again: Metrics.render_from)
        now = time.monotonic()
        pending = {m: 0 for m in d.specs} | d.core.pending_by_model() | d.llm.pending()
        in_flight = {m: 0 for m in pending} | d.core.in_flight_by_model() | d.llm.in_flight()
        rates = {m: round(d.state.arrival(m).rate(now), 3) for m in d.specs}
        return (pending, decisions(d), described_curves(d), rates, in_flight,
                {m: c.describe() for m, c in d.llm.core.curves.items()})

    return d.metrics.render_from(state)
