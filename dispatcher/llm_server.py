"""The LLM mode's socket side inside the dispatcher process: messages in, jobs and replies out.

The dispatcher (server.py) hands this object the LLM messages it reads — ``generate`` from
clients, ``register`` with an ``llm`` engine, ``llm_done`` and heartbeats from vLLM workers —
and calls ``decide`` once per step, on the same thread and event loop. All decisions are in
llm_core.LlmCore; this module only encodes, sends and counts.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from . import protocol as P
from .llm_core import LlmCore, LlmRequest
from .metrics import Metrics
from .protocol import Status

log = logging.getLogger("batchyard.dispatcher")


class LlmDesk:
    def __init__(self, send_worker: Callable[[bytes, bytes], None], reply: Callable[[bytes, bytes], None],
                 default_timeout_s: float, interference_weight: float, worker_dead_after_s: float,
                 metrics: Metrics | None = None, models: tuple = (), max_queue: int = 10_000,
                 stream: Optional[Callable[[bytes, bytes], None]] = None):
        self._send_worker = send_worker
        self._reply = reply
        self._stream = stream or reply  # (a streamed generation's tokens: may be dropped, client_replies)
        self.metrics = metrics if metrics is not None else Metrics()
        self.core = LlmCore(self._on_fail, default_timeout_s=default_timeout_s,
                            interference_weight=interference_weight, worker_dead_after_s=worker_dead_after_s,
                            models=models, max_queue=max_queue)

    # ------------------------------------------------------------------ in
    def on_generate(self, msg: P.GenerateRequest, identity: bytes, now: float, unknown: Callable[[str], str]) -> None:
        why = self.core.admit(msg, identity, now)
        if why is not None:
            if why[0] == Status.UNKNOWN_MODEL:
                self.metrics.unknown_model()  # as the tensor path: no series under a client's name
            else:
                self.metrics.request_failed(msg.model, why[0], msg.priority)
            self._reply(identity, _error(msg.id, why[0], why[1] or unknown(msg.model)))

    def on_register(self, msg: P.Register, identity: bytes, now: float, peer: str = "") -> None:
        again = self.core.is_retry(msg.worker, msg.pid, identity, peer, msg.started)
        self.core.add_worker(msg.worker, identity, msg.llm, now, pid=msg.pid, peer=peer, started=msg.started)
        e = msg.llm
        # As a tensor worker's registration: the model's series on the route this engine serves
        # (a route is named as the role of the engine it starts on) exist from now, at 0.
        self.metrics.model_served(e.model, e.role)
        if not again:  # a retry of a registration already taken (they queue while the dispatcher is down)
            log.info("LLM worker %s registered: pid %d, model %s, role %s%s, %d prefill and %d decode calibration "
                     "samples", msg.worker, msg.pid, e.model, e.role, " (CPU stand-in)" if e.stand_in else "",
                     len(e.prefill), len(e.decode))
        self._send_worker(identity, P.encode(P.Registered(worker=msg.worker)))

    def on_done(self, msg: P.LlmDone, now: float) -> None:
        for f in self.core.complete(msg, now):
            r = f.request
            # Triton's families, one inference per request; its queue and compute times are not
            # told apart (a request's prefill and decode interleave with others'), so all of its
            # time counts as compute.
            self.metrics.request_ok(r.model, f.timing.route, r.priority, 1, 0, f.timing.total_us, f.timing.total_us)
            # One execution per generate request: a generate job holds one request, and the
            # engine's batching of its steps with other streams is no batch the dispatcher formed.
            # So count / exec_count is 1 for an LLM model, and exec_count its generations.
            self.metrics.batch_done(r.model, f.timing.route)
            self._reply(r.client, P.encode(P.GenerateReply(v=P.PROTOCOL_VERSION, id=r.req_id, status=Status.OK,
                                                           tokens=f.tokens, timing=f.timing,
                                                           finish_reason=f.finish_reason, logprobs=f.logprobs,
                                                           prompt_logprobs=f.prompt_logprobs)))

    def cancel(self, client: bytes, req_id: int, finished: bool, now: float) -> None:
        """A client's cancel (``finished``: of a streamed generation it has what it needs of,
        a stop string found; it ends served, as vLLM ends a generation at a stop string)."""
        if not finished:
            self.core.cancel(client, req_id)
            return
        r = self.core.finish(client, req_id)
        if r is not None:
            us = int((now - r.arrival) * 1e6)
            self.metrics.request_ok(r.model, r.route, r.priority, 1, 0, us, us)
            self.metrics.batch_done(r.model, r.route)
            self._reply(r.client, P.encode(P.GenerateReply(v=P.PROTOCOL_VERSION, id=r.req_id, status=Status.OK,
                                                           finish_reason="stop")))

    def on_tokens(self, msg: P.LlmTokens) -> None:
        """A streamed request's tokens, as its engine decoded them, on to its client."""
        r = self.core.streamed(msg)
        if r is not None and msg.tokens:
            self._stream(r.client, P.encode(P.GenerateTokens(v=P.PROTOCOL_VERSION, id=r.req_id, start=msg.start,
                                                            tokens=msg.tokens, logprobs=msg.logprobs,
                                                            prompt_logprobs=msg.prompt_logprobs)))

    def heartbeat(self, name: str, now: float) -> bool:
        return self.core.heartbeat(name, now)

    def lost(self, name: str, reason: str, now: float) -> bool:
        if name not in self.core.workers:
            return False
        self.core.worker_lost(name, reason, now)
        log.log(logging.INFO if reason == "worker stopped" else logging.WARNING,
                "LLM worker %s out of rotation: %s", name, reason)
        return True

    # ------------------------------------------------------------------ out
    def fail_all(self, status: Status, message: str, now: float) -> None:
        """Answer every open request ``status`` and stop in their engines the ones jobs run."""
        self.core.fail_all(status, message)
        self.decide(now)  # the aborts

    def decide(self, now: float) -> int:
        """Send the jobs decided now; -> how many workers turned out to be gone."""
        gone, sends = 0, self.core.decide(now)
        while sends:
            again = False
            for i, send in enumerate(sends):
                if self.core.workers.get(send.worker.name) is not send.worker:
                    continue  # lost at an earlier send of this list: its jobs there were withdrawn
                if self._send_worker(send.worker.identity, P.encode(send.job)):
                    continue
                # Its connection is gone (ROUTER_MANDATORY): out of rotation now. The job was
                # dropped unsaid, and routing kept choosing the worker until its heartbeats were
                # missed (worker_dead_after_s), each request sent there failing only then. Its
                # jobs in this list never ran (this one and those later for the same worker,
                # which the worker's loss failed as "lost while running"): routed again.
                withdrawn = [self.core.withdraw(s.job) for s in sends[i:] if s.worker is send.worker]
                if self.lost(send.worker.name, "unreachable", now):
                    gone += 1
                for kind, kv_from, requests in withdrawn:
                    self.core.route_again(kind, kv_from, requests, now)
                again = True
            sends = self.core.decide(now) if again else []
        return gone

    def housekeeping(self, now: float) -> int:
        """Take silent and hung workers out of rotation; -> how many."""
        lost = self.core.check_liveness(now)
        for name, reason, _failed in lost:
            log.warning("LLM worker %s out of rotation: %s", name, reason)
        return len(lost)

    def worker_infos(self) -> list:
        return [P.WorkerInfo(name=w.name, pid=w.pid, path=w.role, models=[w.engine.model], inflight=len(w.jobs),
                             simulated=False) for w in self.core.workers.values()]

    def busy(self) -> bool:
        return bool(self.core.jobs)

    def pending(self) -> dict[str, int]:
        """Requests waiting for a CPU prefill, per model (the rest are in an engine)."""
        return {m: len(q) for m, q in self.core.cpu_queue.items()}

    def in_flight(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.core.requests.values():
            out[r.model] = out.get(r.model, 0) + 1
        pending = self.pending()
        return {m: n - pending.get(m, 0) for m, n in out.items()}

    def _on_fail(self, r: LlmRequest, status: Status, message: str, param: str = "") -> None:
        """``param``: the request field its engine's refusal named."""
        self.metrics.request_failed(r.model, status, r.priority)
        self._reply(r.client, _error(r.req_id, status, message, param))


def _error(rid, status: Status, message: str, param: str = "") -> bytes:
    return P.encode(P.GenerateReply(v=P.PROTOCOL_VERSION, id=rid, status=int(status), message=message, param=param))
