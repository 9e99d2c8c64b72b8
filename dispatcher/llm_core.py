"""The LLM mode's request lifecycle: routing, prefill batches, KV hand-off, completion. Pure.

No sockets here (llm_server.py is the plumbing), so tests drive it with a fake clock. A request
arrives with its prompt's token ids; the router (llm_routing.choose_route) predicts its TTFT on
both paths from the learned curves (llm_fit.py) and from what each instance has in hand now:

- "prefill-cpu": the request waits in the CPU prefill queue. Whenever a CPU instance is idle the
  queue's head goes to it as one prefill job, sized by marginal cost on token counts
  (llm_routing.take_prefill_batch); the engine stores each prompt's KV for the decode instance.
  When the prefill job ends, each request goes to a GPU instance as a generate job that loads
  that KV (``kv_from``).
- "gpu": a generate job goes to a GPU instance at once; vLLM batches it with the running streams.

Every request ends exactly once: a reply, or a failure through ``on_fail`` (deadline, worker
lost, engine error). Completions refine the curves: CPU prefill from each prefill job, GPU
prefill from generate jobs sent to an idle GPU instance, decode steps and the KV move from the
rest. Priorities are not used in this mode (FIFO per path).
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field
from typing import Callable, Optional

import msgspec

from . import protocol as P
from .llm_fit import LearnedCurves, prefill_features
from .llm_routing import GPU, PREFILL_CPU, LlmCurves, PathLoad, backlog_s, choose_route, take_prefill_batch
from .protocol import Status
from .state import same_process

TOKEN_BUDGET = 4096  # tokens per prefill job: bounds one step's stall (vLLM's own default is 2048-8192)


@dataclass(eq=False)
class LlmRequest:
    client: bytes
    req_id: int
    model: str
    prompt: list
    max_tokens: int
    arrival: float
    deadline: float
    forced: str = ""
    seq: int = 0
    route: str = ""
    pred_cpu: float = 0.0
    pred_gpu: float = 0.0
    prefill_worker: str = ""
    done: bool = False
    priority: int = P.PRIORITY_NORMAL  # as asked: metrics are labelled by it (routing ignores it)
    job_id: int = -1  # the job it is in, while one runs it
    stream: bool = False  # its client takes the tokens as they are decoded (GenerateRequest.stream)
    ignore_eos: bool = False  # max_tokens past an end-of-sequence token too
    sampling: Optional[P.Sampling] = None  # None: greedy


@dataclass(eq=False)
class LlmWorker:
    name: str
    identity: bytes
    engine: P.LlmEngine
    last_seen: float
    jobs: dict = field(default_factory=dict)  # job_id -> Job
    busy_until: float = 0.0  # predicted end of the work sent (prefill: the job; gpu: its prefills)
    pid: int = 0
    peer: str = ""  # the kernel's credentials of the connection it registered on (transport.connection)
    started: str = ""  # its process's Register.started

    @property
    def role(self) -> str:
        return self.engine.role


@dataclass(eq=False)
class Job:
    job_id: int
    worker: LlmWorker
    kind: str
    requests: list
    sent_at: float
    running_at_send: int = 0  # gpu: streams already in the engine when this one went in
    expected_end: float = 0.0  # its worker's predicted busy_until when it was sent


@dataclass
class Send:
    worker: LlmWorker
    job: P.LlmJob | P.LlmAbort


@dataclass
class Finished:
    request: LlmRequest
    tokens: list
    timing: P.LlmTiming
    finish_reason: str
    logprobs: msgspec.Raw  # relayed unread (P.logprobs_raw)
    prompt_logprobs: msgspec.Raw


class LlmCore:
    def __init__(self, on_fail: Callable[..., None], default_timeout_s: float = 30.0,
                 interference_weight: float = 0.0, worker_dead_after_s: float = 10.0, models: tuple = (),
                 max_queue: int = 10_000):
        self.on_fail = on_fail
        # [dispatcher] max_queue bounds each model's open generations (queued for a CPU prefill or
        # in an engine's own queue): it bounded the tensor path only, and 200 generations sent
        # at once to a node of max_queue 5 were all taken.
        self.max_queue = max_queue
        self.open_by_model: dict[str, int] = {}
        # The config's LLM models: one with no engine up (its engines still loading, or lost and
        # restarting) is UNAVAILABLE, not UNKNOWN_MODEL (a 404 "model_not_found" while /v1/models
        # listed it). A model only an engine names counts while that engine is up (kept for good,
        # one a stray engine of an old config registered held the node's strict readiness down).
        self._known: frozenset = frozenset(models)
        self.default_timeout_s = default_timeout_s
        self.interference_weight = interference_weight
        self.worker_dead_after_s = worker_dead_after_s
        self.workers: dict[str, LlmWorker] = {}
        self.curves: dict[str, LearnedCurves] = {}
        self.cpu_queue: dict[str, list] = {}  # model -> FIFO of requests waiting for a CPU prefill
        self.jobs: dict[int, Job] = {}
        self.requests: dict[int, LlmRequest] = {}  # open, by seq
        self._deadlines: list = []  # heap of (deadline, seq)
        self._ids = itertools.count(1 + random.getrandbits(48))  # per run, as RequestCore's batch ids
        self.decisions = {PREFILL_CPU: 0, GPU: 0}
        self.draining = False
        self._out: list = []  # jobs started since the last decide()
        self.hung: dict[str, str] = {}  # worker -> why it was declared hung: told to restart at its next heartbeat

    # ------------------------------------------------------------------ workers
    def models(self) -> set:
        return self._known | {w.engine.model for w in self.workers.values()}

    def add_worker(self, name: str, identity: bytes, engine: P.LlmEngine, now: float, pid: int = 0,
                   peer: str = "", started: str = "") -> list:
        """Register (or re-register) an engine; returns what its re-registration failed."""
        if self.is_retry(name, pid, identity, peer, started):
            # The same process registering again (its retry crossed the answer, or it waited out
            # an engine step longer than its retry period): no restart, its jobs are running. Lost,
            # they failed and their answers were dropped.
            self.workers[name].last_seen = now
            return []
        lost = self.worker_lost(name, "worker re-registered", now, engine) if name in self.workers else []
        self.hung.pop(name, None)
        self.workers[name] = LlmWorker(name, identity, engine, now, pid=pid, peer=peer, started=started)
        # Its calibration replaces what it sent before: appended at every registration, a worker's
        # samples piled up (1000 registrations: 2000 rows) and outweighed what was learnt online.
        self.curves.setdefault(engine.model, LearnedCurves()).seed_engine(engine.role, engine.prefill, engine.decode,
                                                                          source=name)
        self.cpu_queue.setdefault(engine.model, [])
        return lost

    def is_retry(self, name: str, pid: int, identity: bytes, peer: str = "", started: str = "") -> bool:
        """Whether a registration comes from the process already registered under ``name``
        (``state.same_process``, as a tensor worker's). A restarted engine given the same pid (pid
        1 in its container) was taken for the old one: its messages were dropped as another
        connection's, and the request running on the old one failed only when its heartbeats were
        missed."""
        return same_process(self.workers.get(name), pid, identity, peer, started)

    def heartbeat(self, name: str, now: float) -> bool:
        w = self.workers.get(name)
        if w is None:
            return False
        w.last_seen = now
        return True

    def worker_lost(self, name: str, reason: str, now: float, returning: Optional[P.LlmEngine] = None) -> list:
        """Fail what the worker was running. ``returning``: the engine it registers again with
        (a restart), counted as up for its model and role: counted as gone, a GPU instance's
        restart failed every request waiting for or running a CPU prefill, UNAVAILABLE "no 'gpu'
        instance is up", though it was up again in the same call (an outside review)."""
        w = self.workers.pop(name, None)
        if w is None:
            return []
        failed = []
        for job in list(w.jobs.values()):
            del self.jobs[job.job_id]
            for r in job.requests:
                if self._end(r):
                    self.on_fail(r, Status.UNAVAILABLE, f"LLM worker {name} lost while running this request ({reason})")
                    failed.append(r)
        model = w.engine.model

        def up(role: str) -> bool:
            return bool(self._instances(model, role)) or (returning is not None and returning.model == model
                                                            and returning.role == role)

        if not up(GPU):
            # Nothing left to decode them: the requests waiting for a CPU prefill, and those a
            # prefill job runs, failed only once their prefill ended (their KV then left on disk
            # until the sweep). Now, their prefills stopped in the engine.
            prefilling = [r for job in self.jobs.values() if job.kind == "prefill" for r in job.requests
                          if r.model == model]
            queued, self.cpu_queue[model] = self.cpu_queue.get(model, []), []
            for r in (*queued, *prefilling):
                if self._end(r):
                    self.on_fail(r, Status.UNAVAILABLE, f"no 'gpu' LLM instance of {model!r} is up to decode it "
                                                        f"(LLM worker {name} lost: {reason})")
                    self._abort(r)
                    failed.append(r)
        if not up(PREFILL_CPU):
            queued, self.cpu_queue[model] = self.cpu_queue.get(model, []), []
            failed += self._off_the_cpu_path(queued, now)
        return failed

    def _off_the_cpu_path(self, requests: list, now: float) -> list:
        """Requests for a CPU prefill with no CPU instance left go to the GPU path rather than
        wait forever, but for those that forced the CPU route: served on the GPU, they were
        answered OK with route "gpu", where admitted now they are refused. -> those refused."""
        refused = []
        for r in requests:
            if r.forced == PREFILL_CPU:
                self._end(r)
                self.on_fail(r, Status.UNAVAILABLE, _no_cpu_instance(r.model))
                refused.append(r)
            else:
                r.route = GPU
                self._to_gpu(r, now, kv_from="")
        return refused

    def withdraw(self, msg) -> tuple[str, str, list]:
        """A job sent to a worker whose connection turned out gone, so it never ran: out of the
        books before the worker's loss fails what the worker was running. -> (its kind, its
        kv_from, its open requests), for ``route_again`` once the worker is out of rotation."""
        job = self.jobs.pop(msg.job_id, None) if type(msg) is P.LlmJob else None
        if job is None:
            return "", "", []
        job.worker.jobs.pop(job.job_id, None)
        for r in job.requests:
            r.job_id = -1
        return job.kind, msg.kv_from, [r for r in job.requests if not r.done]

    def route_again(self, kind: str, kv_from: str, requests: list, now: float) -> None:
        """Requests of a job that never reached its worker, now gone: a prefill's go back to the
        head of the CPU queue, or where no CPU instance is left to the GPU path (as a lost
        worker's queue goes), unless they forced the CPU route; a generate's to another GPU
        instance. They failed UNAVAILABLE "lost while running", the GPU instance up."""
        if kind == "prefill" and requests:
            model = requests[0].model
            for r in requests:
                r.prefill_worker = ""
            if self._instances(model, PREFILL_CPU):
                self.cpu_queue[model][:0] = requests
            else:
                self._off_the_cpu_path(requests, now)
            return
        for r in requests:
            self._to_gpu(r, now, kv_from)

    def check_liveness(self, now: float) -> list:
        """Take out of rotation the workers silent past ``worker_dead_after_s``, and those holding
        a job whose every request has ended, its last deadline that long ago (``hung``). An engine
        heartbeats from a thread of its own: one stuck in a step kept beating, stayed in rotation,
        and every request routed to it ran out its deadline. The job's predicted end counts as a
        deadline here."""
        dead_before = now - self.worker_dead_after_s
        lost = [(w.name, "silent past worker_dead_after_s") for w in self.workers.values() if w.last_seen < dead_before]
        for job in self.jobs.values():
            # Not before the job's predicted end either: an engine sees an abort between steps,
            # and one unchunked prefill step of a long prompt is predicted to take long.
            if (all(r.done for r in job.requests) and job.worker.name not in self.hung
                    and max(job.expected_end, *(r.deadline for r in job.requests)) < dead_before):
                reason = (f"{job.kind} job {job.job_id} sent {now - job.sent_at:.1f} s ago never came back, "
                          f"{self.worker_dead_after_s:.1f} s past its last request's deadline")
                self.hung[job.worker.name] = reason
                lost.append((job.worker.name, reason))
        return [(name, reason, self.worker_lost(name, reason, now)) for name, reason in dict(lost).items()]

    def _instances(self, model: str, role: str) -> list:
        return [w for w in self.workers.values() if w.engine.model == model and w.role == role]

    # ------------------------------------------------------------------ arrivals
    def admit(self, msg: P.GenerateRequest, client: bytes, now: float):
        """Returns why it is refused, (status, message), or None when the request is in. An
        unknown model comes back with an empty message: the caller knows every model's name."""
        model = msg.model
        if model not in self.models():
            # Before the drain's refusal: refused for the drain, a made-up name was counted as a
            # failure of that name, a metric series per name a client sent.
            return Status.UNKNOWN_MODEL, ""
        if self.draining:
            return Status.UNAVAILABLE, "dispatcher is shutting down"
        gpus = self._instances(model, GPU)
        if not gpus:
            return Status.UNAVAILABLE, f"no 'gpu' LLM instance of {model!r} is up; the decode runs there"
        limit = min(w.engine.max_model_len for w in gpus)
        if limit and len(msg.prompt) + msg.max_tokens > limit:
            return (Status.INVALID_ARGUMENT, f"prompt of {len(msg.prompt)} tokens + max_tokens {msg.max_tokens} "
                                             f"exceeds max_model_len {limit} of model {model!r}")
        if msg.sampling is not None and msg.sampling.min_tokens > msg.max_tokens:  # (vLLM's words)
            return (Status.INVALID_ARGUMENT, f"min_tokens must be less than or equal to max_tokens={msg.max_tokens}, "
                                             f"got {msg.sampling.min_tokens}")
        route = msg.route
        if msg.sampling is not None:
            if (entries := logprob_entries(msg)) > P.MAX_LOGPROB_ENTRIES:
                return (Status.INVALID_ARGUMENT, f"the logprobs asked make {entries} entries (a prompt token's but "
                                                 "the first's, and max_tokens', each 1 + the logprobs asked); at most "
                                                 f"{P.MAX_LOGPROB_ENTRIES} a request: ask fewer tokens or fewer logprobs")
            if msg.sampling.prompt_logprobs is not None:
                # An engine gives the logprobs of the prompt tokens it computes: not of KV it loads.
                if route == PREFILL_CPU:
                    return (Status.INVALID_ARGUMENT, "prompt_logprobs are computed by the decode instance's own "
                                                     "prefill: not on route 'prefill-cpu'")
                route = GPU
        if route == PREFILL_CPU and not self._instances(model, PREFILL_CPU):
            return Status.UNAVAILABLE, _no_cpu_instance(model)
        if self.open_by_model.get(model, 0) >= self.max_queue:
            return Status.OVERLOADED, f"queue for {model!r} is full ({self.max_queue} requests)"
        timeout = msg.timeout_us / 1e6 if msg.timeout_us else self.default_timeout_s
        r = LlmRequest(client, msg.id, model, list(msg.prompt), msg.max_tokens, now, now + timeout, route,
                       seq=next(self._ids), priority=msg.priority, stream=msg.stream, ignore_eos=msg.ignore_eos,
                       sampling=msg.sampling)
        self.requests[r.seq] = r
        self.open_by_model[model] = self.open_by_model.get(model, 0) + 1
        self._compact_deadlines()
        heapq.heappush(self._deadlines, (r.deadline, r.seq))
        try:
            self._route(r, now)
        except BaseException:
            # Not admitted after all: the caller answers it, once; kept, it would be answered
            # again at its deadline.
            if self.requests.pop(r.seq, None) is not None:
                self.open_by_model[model] -= 1
            raise
        return None

    def _compact_deadlines(self) -> None:
        """Drop the deadlines of ended requests once they outnumber the open ones. Below an open
        request with a later deadline they never reach the heap's top: one long generation kept
        an entry for every request served after it, until each one's own deadline."""
        if len(self._deadlines) > 2 * len(self.requests) + 64:
            self._deadlines = [e for e in self._deadlines if e[1] in self.requests]
            heapq.heapify(self._deadlines)

    def load(self, model: str, now: float) -> PathLoad:
        curves = self.curves[model]
        cpu = self._instances(model, PREFILL_CPU)
        cpu_rest = min((max(0.0, w.busy_until - now) for w in cpu), default=0.0)
        cpu_backlog = backlog_s(cpu_rest, [len(r.prompt) for r in self.cpu_queue[model]], curves.prefill(PREFILL_CPU),
                                0.0, TOKEN_BUDGET) if cpu else float("inf")
        gpu = self._pick_gpu(model, now)
        return PathLoad(cpu_backlog_s=cpu_backlog, gpu_backlog_s=max(0.0, gpu.busy_until - now),
                        gpu_running=len(gpu.jobs))

    def routing_curves(self, model: str) -> LlmCurves:
        return self.curves[model].routing()

    def _route(self, r: LlmRequest, now: float) -> None:
        load = self.load(r.model, now)
        block = min(w.engine.block_size for w in self._instances(r.model, GPU))
        choice = choose_route(len(r.prompt), load, self.routing_curves(r.model), self.interference_weight, block)
        r.pred_cpu, r.pred_gpu = choice.ttft_cpu_s, choice.ttft_gpu_s
        r.route = r.forced or choice.path
        self.decisions[r.route] += 1
        if r.route == PREFILL_CPU:
            self.cpu_queue[r.model].append(r)
        else:
            self._to_gpu(r, now, kv_from="")

    def _pick_gpu(self, model: str, now: float) -> LlmWorker:
        # A busy_until already past means idle now, however long ago it passed: compared as is,
        # an instance running many streams beat an idle one whose last prefill ended later, and
        # the streams it runs never broke the tie.
        return min(self._instances(model, GPU), key=lambda w: (max(now, w.busy_until), len(w.jobs)))

    def _to_gpu(self, r: LlmRequest, now: float, kv_from: str) -> None:
        gpus = self._instances(r.model, GPU)
        if not gpus:
            self._end(r)
            self.on_fail(r, Status.UNAVAILABLE, f"no 'gpu' LLM instance of {r.model!r} is up")
            return
        w = self._pick_gpu(r.model, now)
        curves = self.curves[r.model]
        step = curves.decode().step(len(w.jobs) + 1)
        first = (curves.kv_link().transfer_s(len(r.prompt)) if kv_from
                 else curves.prefill(GPU).time(len(r.prompt)))
        w.busy_until = max(now, w.busy_until) + first + step
        job = Job(next(self._ids), w, "generate", [r], now, running_at_send=len(w.jobs))
        self._start(job, P.LlmJob(job_id=job.job_id, kind="generate", seqs=[r.seq], prompts=[r.prompt],
                                  max_tokens=[r.max_tokens], kv_from=kv_from, order=[r.seq], stream=r.stream,
                                  ignore_eos=r.ignore_eos, sampling=r.sampling))

    def _start(self, job: Job, msg: P.LlmJob) -> None:
        job.expected_end = job.worker.busy_until
        for r in job.requests:
            r.job_id = job.job_id
        self.jobs[job.job_id] = job
        job.worker.jobs[job.job_id] = job
        self._out.append(Send(job.worker, msg))

    # ------------------------------------------------------------------ decisions
    def decide(self, now: float) -> list:
        """Expire what is late, start prefill jobs on idle CPU instances; the jobs to send."""
        out, self._out = self._out, []
        self._expire(now)
        for model, queue in self.cpu_queue.items():
            for w in self._instances(model, PREFILL_CPU):
                if not queue:
                    break
                if w.jobs:
                    continue
                curve = self.curves[model].prefill(PREFILL_CPU)
                limit = w.engine.max_num_seqs or len(queue)
                n = take_prefill_batch([len(r.prompt) for r in queue[:limit]], curve, TOKEN_BUDGET)
                batch, queue[:n] = queue[:n], []
                for r in batch:
                    r.prefill_worker = w.name
                w.busy_until = now + curve.batch_time([len(r.prompt) for r in batch])
                job = Job(next(self._ids), w, "prefill", batch, now)
                self._start(job, P.LlmJob(job_id=job.job_id, kind="prefill", seqs=[r.seq for r in batch],
                                          prompts=[r.prompt for r in batch], max_tokens=[1] * len(batch),
                                          order=[r.seq for r in batch]))
        out.extend(self._out)
        self._out = []
        return out

    def next_wake(self) -> float:
        while self._deadlines and self._deadlines[0][1] not in self.requests:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else float("inf")

    def _expire(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, seq = heapq.heappop(self._deadlines)
            r = self.requests.get(seq)
            if r is not None and self._end(r):
                queue = self.cpu_queue.get(r.model, [])
                if r in queue:
                    queue.remove(r)
                self.on_fail(r, Status.DEADLINE_EXCEEDED, f"deadline passed after {now - r.arrival:.3f} s "
                                                          f"(route {r.route})")
                self._abort(r)

    def _abort(self, r: LlmRequest) -> None:
        """``r`` was answered while a job runs it: the engine stops it. Left, it decoded to its
        max_tokens for nobody, holding a slot and KV blocks the requests behind it waited for."""
        job = self.jobs.get(r.job_id)
        if job is not None and r in job.requests:
            self._out.append(Send(job.worker, P.LlmAbort(job_id=job.job_id, seqs=[r.seq])))

    def cancel(self, client: bytes, req_id: int) -> bool:
        """Cancel a request: one waiting for a CPU prefill leaves the queue, one a job runs is
        stopped in its engine; it is answered CANCELLED. A client's cancel reached only the
        tensor core: the request ran."""
        for queue in self.cpu_queue.values():
            for r in queue:
                if r.client == client and r.req_id == req_id and not r.done:
                    queue.remove(r)
                    self._end(r)
                    self.on_fail(r, Status.CANCELLED, "cancelled by the client while queued")
                    return True
        r = self._running(client, req_id)
        if r is not None and self._end(r):
            self.on_fail(r, Status.CANCELLED, "cancelled by the client while it ran")
            self._abort(r)
            return True
        return False

    def _running(self, client: bytes, req_id: int) -> Optional[LlmRequest]:
        """The client's request of that id that a job runs and that is not done, or None."""
        return next((r for r in self.requests.values()
                     if r.client == client and r.req_id == req_id and r.job_id in self.jobs and not r.done), None)

    def finish(self, client: bytes, req_id: int) -> Optional[LlmRequest]:
        """A running generation its client has what it needs of (a stop string): stopped in its
        engine as a cancelled one, but not answered here -> it, for the caller to answer as
        served. One not running yet is cancelled (-> None)."""
        r = self._running(client, req_id)
        if r is not None and self._end(r):
            self._abort(r)
            return r
        self.cancel(client, req_id)
        return None

    def _end(self, r: LlmRequest) -> bool:
        if r.done:
            return False
        r.done = True
        if self.requests.pop(r.seq, None) is not None:
            self.open_by_model[r.model] -= 1
        return True

    # ------------------------------------------------------------------ completions
    def streamed(self, msg: P.LlmTokens) -> Optional[LlmRequest]:
        """The open request whose decoded tokens ``msg`` holds, or None: sent by a worker that
        does not run that job (one declared lost), for a request answered already (its
        deadline, a cancel; the abort is on its way), or of a job that is not its generate job."""
        job = self.jobs.get(msg.job_id)
        if job is None or job.worker.name != msg.worker or job.kind != "generate":
            return None
        r = self.requests.get(msg.seq)
        return r if r is not None and r.stream and r.job_id == job.job_id and not r.done else None

    def complete(self, msg: P.LlmDone, now: float) -> list:
        """A job ended: hand prefilled requests on to a GPU, return the requests that finished."""
        job = self.jobs.get(msg.job_id)
        if job is None or job.worker.name != msg.worker:
            # From a worker declared lost, for a job already failed over, or not this job's worker
            # (the job stays: its own worker's answer is still to come).
            return []
        del self.jobs[msg.job_id]
        del job.worker.jobs[job.job_id]
        by_seq = {r.seq: r for r in job.requests}
        finished: list = []
        curves = self.curves[job.requests[0].model]
        if job.kind != "prefill" and not job.worker.jobs:
            # A GPU with no job left has no prefill backlog either: the predicted prefills of jobs
            # that ended early (cancelled, past their deadline) were never given back, and 300
            # cancelled long prompts left an idle GPU predicted busy for 13 s, new requests sent
            # to the slower CPU path meanwhile (an outside review).
            job.worker.busy_until = min(job.worker.busy_until, now)
        if job.kind == "prefill":
            job.worker.busy_until = now
            ok = [res for res in msg.results if res.status == Status.OK]
            if ok and len(ok) == len(job.requests):
                curves.cpu_prefill.add(prefill_features([len(r.prompt) for r in job.requests]), msg.compute_s)
        for res in msg.results:
            r = by_seq.pop(res.seq, None)
            if r is None or r.done:
                continue
            if res.status != Status.OK:
                self._end(r)
                self.on_fail(r, Status(res.status) if res.status in Status._value2member_map_ else Status.INTERNAL,
                             res.message or "LLM engine failed this request", param=res.param)
            elif job.kind == "prefill":
                self._to_gpu(r, now, kv_from=job.worker.name)
            else:
                self._learn_generate(curves, job, r, res, msg.compute_s)
                self._end(r)
                finished.append(self._finished(r, job, res, now, msg.compute_s))
        for r in by_seq.values():  # a result the worker did not send must not strand its request
            if self._end(r):
                self.on_fail(r, Status.INTERNAL, f"LLM worker {msg.worker} returned no result for this request")
        return finished

    def _learn_generate(self, curves: LearnedCurves, job: Job, r: LlmRequest, res: P.LlmResult,
                        elapsed_s: float) -> None:
        # generate jobs hold one request: the job's elapsed time is that request's
        n_out = len(res.tokens)
        if n_out > 1 and 0 < res.first_token_s < elapsed_s:
            per_step = (elapsed_s - res.first_token_s) / (n_out - 1)
            curves.gpu_decode.add((1.0, float(job.running_at_send + 1)), per_step)
        if res.first_token_s <= 0:
            return
        if r.prefill_worker:
            # KV loaded, then one step with the streams running then: the move is the rest. Every
            # hand-off is a sample (the decode step is learned apart), not only those to an idle engine.
            move = res.first_token_s - curves.decode().step(job.running_at_send + 1)
            if move > 0:
                curves.kv.add((1.0, float(res.kv_tokens or len(r.prompt))), move)
        elif job.running_at_send == 0:
            curves.gpu_prefill.add(prefill_features([len(r.prompt)]), res.first_token_s)

    def _finished(self, r: LlmRequest, job: Job, res: P.LlmResult, now: float, compute_s: float) -> Finished:
        stand_in = job.worker.engine.stand_in
        # On the dispatcher's clock: the whole time, less what the worker spent after the first token.
        total = now - r.arrival
        ttft = min(total, max(0.0, total - max(0.0, compute_s - res.first_token_s)))
        timing = P.LlmTiming(ttft_us=int(ttft * 1e6), total_us=int(total * 1e6), route=r.route, decode_worker=job.worker.name,
                             prefill_worker=r.prefill_worker, kv_tokens=res.kv_tokens,
                             predicted_ttft_cpu_us=_us(r.pred_cpu), predicted_ttft_gpu_us=_us(r.pred_gpu),
                             stand_in=stand_in)
        return Finished(r, list(res.tokens), timing, res.finish_reason, res.logprobs, res.prompt_logprobs)

    # ------------------------------------------------------------------ drain
    def begin_drain(self) -> None:
        self.draining = True

    def fail_all(self, status: Status, message: str) -> None:
        """Answer every open request; those a job runs are stopped in their engine (the next
        ``decide`` sends the aborts): an engine that outlives the dispatcher (a separate unit, or
        one that registers with the next dispatcher) decoded them to max_tokens for nobody."""
        for r in list(self.requests.values()):
            if self._end(r):
                self.on_fail(r, status, message)
                self._abort(r)
        for q in self.cpu_queue.values():
            q.clear()

    def describe(self) -> dict:
        return {m: {"curves": c.describe(), "cpu_queue": len(self.cpu_queue.get(m, ()))}
                for m, c in self.curves.items()} | {"_decisions": dict(self.decisions)}


def logprob_entries(msg: P.GenerateRequest) -> int:
    """The (token id, logprob, rank) entries a generation's reply holds at most: 1 + logprobs for
    each token it may decode, 1 + prompt_logprobs for each prompt token but the first."""
    s, n = msg.sampling, 0
    if s.logprobs is not None:
        n += msg.max_tokens * (s.logprobs + 1)
    if s.prompt_logprobs is not None:
        n += (len(msg.prompt) - 1) * (s.prompt_logprobs + 1)
    return n


def _no_cpu_instance(model: str) -> str:
    return f"route 'prefill-cpu' asked, but no prefill-cpu instance of {model!r} is up"


def _us(seconds: float) -> int:
    return int(seconds * 1e6) if seconds < 1e9 else 0
