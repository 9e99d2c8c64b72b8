"""The LLM worker (kind "vllm"): one vLLM engine, stepped in this process, serving LlmJobs.

Role "prefill-cpu" runs prefill jobs (max_tokens=1) and stores each prompt's KV in the folder
the node's instances share; role "gpu" runs generate jobs, loading that KV when the job names
the instance that stored it (``kv_from``), and deletes it once used. Engine, KV connector and
calibration live in llm_engine.py; this module is the process: registration, heartbeat, the loop.

Loop: block on the socket while the engine is idle; while it has work, look at the socket
without waiting between `engine.step()` calls, so that jobs join the running batch (continuous
batching) and several generate jobs run at once.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import secrets
import shutil
import signal
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from batchyard import protocol as P
from batchyard.exit_codes import EX_CONFIG
from batchyard.llm_model_files import eos_token_ids
from batchyard.proctitle import set_title
from batchyard.protocol import Status
from batchyard.sd_notify import notify

from .llm_engine import (LOAD, STORE, Calibrator, build_engine, check_job, kv_entry, kv_root,
                         masked_until_min_tokens, prepare_kv_dir, sampling_kwargs, set_bad_words, set_env,
                         sweep_stale)
from .runtime import error_text

log = logging.getLogger("batchyard.worker")
REGISTER_RETRY_S = 2.0
KV_SWEEP_S = 60.0  # how often a worker removes KV entries past llm_engine.KV_STALE_S


class _Stop(BaseException):
    """SIGTERM/SIGINT while starting: nothing registered yet, just leave. A BaseException so
    that no `except Exception` inside vLLM swallows it."""


@dataclass(eq=False)
class _Job:
    msg: P.LlmJob
    t0: float  # receipt, perf_counter
    results: dict = field(default_factory=dict)  # seq -> LlmResult
    open: int = 0  # requests still in the engine


@dataclass(eq=False)
class _Req:
    job: _Job
    seq: int
    kv_entry: str = ""  # the moved KV this request loads: deleted once no request uses it
    kv_written: float = 0.0  # the entry's newest file time when this request was added
    tokens: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # one P.PositionLogprobs a token, where asked
    prompt_logprobs: list = field(default_factory=list)  # ... a prompt token but the first
    first_s: float = 0.0


class _WakeEvent(threading.Event):
    """The heartbeat thread's "reregister" flag, also waking the loop blocked on its poll."""

    def __init__(self, fd: int):
        super().__init__()
        self.fd = fd

    def set(self) -> None:
        super().set()
        try:
            os.write(self.fd, b"r")
        except BlockingIOError:
            pass  # the pipe is full: the loop wakes anyway


class LlmServer:
    def __init__(self, node, wcfg, engine, root: Path, engine_msg: P.LlmEngine, vocab: int, eos: tuple = ()):
        self.node, self.name, self.engine, self.root, self.vocab = node, wcfg.name, engine, root, vocab
        self.eos = eos  # the model's end-of-sequence token ids (llm_model_files.eos_token_ids)
        self.block, self.max_len = engine_msg.block_size, engine_msg.max_model_len
        self.register = P.encode(P.Register(v=P.PROTOCOL_VERSION, worker=self.name, pid=os.getpid(),
                                            path="cpu" if engine_msg.role == "prefill-cpu" else "gpu", models=[],
                                            max_inflight=engine_msg.max_num_seqs, simulated=False, llm=engine_msg,
                                            started=secrets.token_hex(8)))
        self.reqs: dict[str, _Req] = {}
        self.kv_users: collections.Counter = collections.Counter()
        self.ids = itertools.count()
        self.stopping = False
        self.registered = False

    def request_stop(self, *_args) -> None:
        from .runtime import exit_after_grace

        self.stopping = True
        exit_after_grace()

    def serve(self, started: float) -> int:
        from batchyard.transport import secure_worker_socket

        from .runtime import Heartbeat

        d = self.node.dispatcher
        secure = lambda sock: secure_worker_socket(sock, d, d.backend)  # noqa: E731
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.name.encode())
        sock.setsockopt(zmq.LINGER, 500)
        secure(sock)
        sock.connect(d.backend)
        hb = Heartbeat(ctx, d.backend, self.name, d.heartbeat_interval_s, secure)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        hb.reregister = _WakeEvent(wake_w)
        # A signal handler only sets a flag; the wake-up fd ends the poll blocked on the socket.
        signal.set_wakeup_fd(wake_w)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self.request_stop)
        self.started, self.sock, self.hb, self.wake_r = started, sock, hb, wake_r
        try:
            return self._loop()
        finally:
            signal.set_wakeup_fd(-1)
            if self.registered:
                sock.send(P.encode(P.Goodbye(worker=self.name)), zmq.NOBLOCK)
            hb.end()  # (closes the socket of one never started: ctx.term() below waited for it)
            sock.close(linger=500)
            ctx.term()
            os.close(wake_r)
            os.close(wake_w)
            log.info("worker %s stopped serving", self.name)

    def _loop(self) -> int:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.wake_r, zmq.POLLIN)
        next_register = 0.0
        next_sweep = time.monotonic() + KV_SWEEP_S
        while not self.stopping:
            if self.hb.reregister.is_set():
                self.hb.reregister.clear()
                self.registered, next_register = False, 0.0
                self._forget_jobs()
            now = time.monotonic()
            if not self.registered and now >= next_register:
                self.sock.send(self.register)
                next_register = now + REGISTER_RETRY_S
            if now >= next_sweep:
                # KV a prefill stored for a request that ended meanwhile (its deadline, a cancel)
                # is never loaded, so never removed by the decode instance: swept here, not only
                # at the next start.
                next_sweep = now + KV_SWEEP_S
                removed = sweep_stale(self.root, keep=self.kv_users)
                if removed:
                    log.info("worker %s removed %d stale KV entries", self.name, removed)
            busy = self.engine.has_unfinished_requests()
            wait = next_sweep - now if self.registered else min(next_sweep, next_register) - now
            timeout = 0 if busy else max(0.0, wait) * 1000
            events = dict(poller.poll(timeout))
            if self.wake_r in events:
                while _drain(self.wake_r):
                    pass
            while self.sock in events:
                try:
                    raw = self.sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                rc = self._on_message(raw)
                if rc is not None:
                    return rc
            if self.engine.has_unfinished_requests() and not self._step():
                return 1
        return 0

    def _on_message(self, raw: bytes) -> int | None:
        try:
            msg = P.to_worker_decoder.decode(raw)
        except P.DecodeError as e:
            log.error("worker %s: undecodable message from the dispatcher: %s", self.name, e)
            return None
        if type(msg) is P.LlmJob:
            self._start_job(msg)
        elif type(msg) is P.LlmAbort:
            self._abort(msg)
        elif type(msg) is P.Registered:
            if not self.registered:
                log.info("worker %s registered %.1f s after start", self.name, time.monotonic() - self.started)
                notify("READY=1")  # systemd's Type=notify: taking traffic now
            self.registered = True
            if not self.hb.is_alive() and not self.hb.stop.is_set():
                self.hb.start()
        elif type(msg) is P.Reregister:
            self.registered = False
            self._forget_jobs()
        elif type(msg) is P.RegisterRejected:
            log.error("dispatcher rejected worker %s: %s", self.name, msg.message)
            return EX_CONFIG
        else:
            log.error("worker %s: an LLM worker got a %s message; ignored", self.name, type(msg).__name__)
        return None

    # -------------------------------------------------------------- jobs
    def _start_job(self, msg: P.LlmJob) -> None:
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        job = _Job(msg, time.perf_counter())
        kv = STORE if msg.kind == "prefill" else LOAD if msg.kv_from else ""
        for i, (seq, why) in enumerate(zip(msg.seqs, check_job(msg, self.max_len, self.vocab))):
            if why:
                job.results[seq] = P.LlmResult(seq=seq, status=int(Status.INVALID_ARGUMENT), message=why)
                continue
            max_tokens = 1 if msg.kind == "prefill" else msg.max_tokens[i]
            rid = f"{msg.job_id}-{seq}-{next(self.ids)}"  # job ids may repeat after a dispatcher restart
            entry, written, loads = "", 0.0, kv
            if kv == LOAD:
                entry = kv_entry(self.root, msg.prompts[i], self.block)
                written = _newest_file_time(entry)
                if not written:
                    # Gone (prompts sharing whole KV blocks share one entry, and the request that
                    # used it last removed it): vLLM's connector raised inside engine.step(), and
                    # the worker failed every request it held and exited. Its own prefill instead.
                    log.warning("worker %s: the moved KV of job %d is gone: prefilled here", self.name, msg.job_id)
                    entry, loads = "", ""
            # (a prefill decodes its one token whatever it is: the generate job decodes it again)
            eos = () if msg.kind == "prefill" or msg.ignore_eos else self.eos
            sampling = None if msg.kind == "prefill" else msg.sampling
            params = SamplingParams(output_kind=RequestOutputKind.DELTA,
                                    **sampling_kwargs(max_tokens, loads, eos, sampling))
            masked_until_min_tokens(params, self.eos, sampling)
            set_bad_words(params, sampling)
            try:
                order = msg.order[i] if len(msg.order) == len(msg.seqs) else 0
                self.engine.add_request(rid, TokensPrompt(prompt_token_ids=list(msg.prompts[i])), params,
                                        priority=order)
            except Exception as e:  # vLLM's validation errors: ValueErrors, and its client errors (the request's fault)
                status = Status.INVALID_ARGUMENT if isinstance(e, (ValueError, VLLMClientError)) else Status.INTERNAL
                # vLLM's validation error in its own words, and the field it names, as its server
                # answers it (the OpenAI routes' 400 named no param, its text behind a prefix)
                param = getattr(e, "parameter", None)
                job.results[seq] = P.LlmResult(
                    seq=seq, status=int(status), param=param if isinstance(param, str) else "",
                    message=error_text(e, typed=False) if param else f"engine refused the request: {error_text(e)}")
                continue
            self.reqs[rid] = _Req(job, seq, kv_entry=entry, kv_written=written)
            if entry:
                self.kv_users[entry] += 1
            job.open += 1
        if not job.open:
            self._send_done(job)

    def _abort(self, msg: P.LlmAbort) -> None:
        """The dispatcher answered these requests already (deadline, cancel): out of the engine
        now, their slots and KV blocks free for the others; the job ends as it would."""
        seqs = set(msg.seqs)
        for rid, req in list(self.reqs.items()):
            if req.job.msg.job_id == msg.job_id and req.seq in seqs:
                self.engine.abort_request([rid])
                self._finish(rid, Status.CANCELLED, "stopped by the dispatcher (its client was answered)")

    def _forget_jobs(self) -> None:
        """Asked to register again, by a dispatcher that restarted (or that took this worker
        out of rotation, failing its jobs over): nobody waits for the requests in the engine any
        more, so out of it now. They decoded on, up to their max_tokens, holding slots and KV
        blocks the new dispatcher's jobs then waited for."""
        if self.reqs:
            log.warning("worker %s: asked to register again; the %d requests in its engine are stopped (their "
                        "dispatcher is gone or failed them over)", self.name, len(self.reqs))
        for rid in list(self.reqs):
            self.engine.abort_request([rid])
            self._finish(rid, Status.CANCELLED, "stopped: the dispatcher asked this worker to register again")

    def _step(self) -> bool:
        """One engine step; False when the engine failed (its state is not to be trusted: every
        job in flight fails, and the worker exits for `up` or systemd to restart it)."""
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.exception("worker %s: engine step failed", self.name)
            for rid in list(self.reqs):
                self._finish(rid, Status.INTERNAL, f"LLM engine failed: {error_text(e)}")
            return False
        now = time.perf_counter()
        for out in outputs:
            req = self.reqs.get(out.request_id)
            if req is None:
                continue
            comp = out.outputs[0] if out.outputs else None
            # (all at once, with the prefill's step: their first position, the prompt's first token's, is None)
            prompt_logprobs = position_logprobs(out.prompt_logprobs[1:]) if out.prompt_logprobs else []
            req.prompt_logprobs.extend(prompt_logprobs)
            if comp is not None and comp.token_ids:
                if not req.tokens:
                    req.first_s = now - req.job.t0
                req.tokens.extend(comp.token_ids)
                logprobs = position_logprobs(comp.logprobs)
                req.logprobs.extend(logprobs)
                if req.job.msg.stream and req.job.msg.kind == "generate" and not out.finished:
                    # (a finishing step's tokens go in the job's LlmDone, which holds them all)
                    self.sock.send(P.encode(P.LlmTokens(job_id=req.job.msg.job_id, worker=self.name, seq=req.seq,
                                                        start=len(req.tokens) - len(comp.token_ids),
                                                        tokens=list(comp.token_ids), logprobs=P.logprobs_raw(logprobs),
                                                        prompt_logprobs=P.logprobs_raw(prompt_logprobs))))
            if out.finished:
                reason = comp.finish_reason if comp is not None else None
                if reason in ("length", "stop"):
                    # Prefix caching is off, so every cached token came from the moved KV.
                    self._finish(out.request_id, Status.OK, "", out.num_cached_tokens or 0, reason)
                else:
                    self._finish(out.request_id, Status.INTERNAL, f"LLM engine ended the request: {reason}")
        return True

    def _finish(self, rid: str, status: Status, message: str, kv_tokens: int = 0, reason: str = "") -> None:
        req = self.reqs.pop(rid)
        ok = status == Status.OK
        req.job.results[req.seq] = P.LlmResult(seq=req.seq, status=int(status), message=message,
                                               tokens=req.tokens if ok else [],
                                               first_token_s=req.first_s if ok else 0.0, kv_tokens=kv_tokens,
                                               finish_reason=reason,
                                               logprobs=P.logprobs_raw(req.logprobs if ok else []),
                                               prompt_logprobs=P.logprobs_raw(req.prompt_logprobs if ok else []))
        if req.kv_entry:
            self.kv_users[req.kv_entry] -= 1
            if self.kv_users[req.kv_entry] <= 0:  # the moved KV served its request: free the disk
                del self.kv_users[req.kv_entry]
                # ... unless stored again since (another prompt of the same whole blocks, its
                # decode job on its way here): the sweep takes it once it is stale.
                if _newest_file_time(req.kv_entry) <= req.kv_written:
                    shutil.rmtree(req.kv_entry, ignore_errors=True)
        req.job.open -= 1
        if not req.job.open:
            self._send_done(req.job)

    def _send_done(self, job: _Job) -> None:
        results = [job.results[s] for s in dict.fromkeys(job.msg.seqs) if s in job.results]
        self.sock.send(P.encode(P.LlmDone(job_id=job.msg.job_id, worker=self.name,
                                          compute_s=time.perf_counter() - job.t0, results=results)))


def position_logprobs(logprobs) -> list:
    """vLLM's logprobs of a step's tokens (one {token id: Logprob} a position, the decoded
    token first, then the most likely by rank; None where the request asked none) as the
    wire's P.PositionLogprobs."""
    if not logprobs:
        return []
    return [[(tid, lp.logprob, lp.rank) for tid, lp in position.items()] for position in logprobs]


def _newest_file_time(folder: str) -> float:
    """The newest modification time of the files in ``folder``; 0.0 when it has none (or is gone)."""
    try:
        with os.scandir(folder) as entries:
            return max((e.stat().st_mtime for e in entries if e.is_file()), default=0.0)
    except OSError:
        return 0.0


def _drain(fd: int) -> bool:
    try:
        return bool(os.read(fd, 4096))
    except BlockingIOError:
        return False


def serve_llm(node, wcfg, fast_exit: bool = True) -> int:
    """Run the worker until SIGTERM/SIGINT; returns its exit status. With ``fast_exit`` the
    process ends itself once the engine is shut down: the interpreter's own teardown of torch
    and vLLM took 1.8 s more here, and leaves nothing to clean (the sockets are closed, and the
    engine's shutdown removed its rendezvous file in /tmp)."""
    started = time.monotonic()
    set_env(wcfg)

    def stop_starting(*_args):
        raise _Stop

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop_starting)
    built: list = []  # the engine once it exists: shut down whichever way we leave
    try:
        rc = _start_and_serve(node, wcfg, started, built)
    except _Stop:
        rc = 0
    if built:
        try:
            built[0].engine_core.shutdown()
        except Exception:
            log.exception("worker %s: engine shutdown failed", wcfg.name)
        if fast_exit:
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
    return rc


def _start_and_serve(node, wcfg, started: float, built: list) -> int:
    try:
        import vllm  # noqa: F401  (only whether it imports)
    except ImportError as e:
        log.error("worker %s: vLLM cannot be imported by %s (%s). Build the LLM environment with "
                  "`make llm-env` and name its interpreter in [workers.vllm] python (e.g. .venv-llm/bin/python)",
                  wcfg.name, sys.executable, e)
        return EX_CONFIG
    vcfg, model = wcfg.vllm, node.llm_model(wcfg.models[0])
    root = kv_root(node.dispatcher.backend, model.name, model.kv_dir)
    try:
        prepare_kv_dir(root, default=not model.kv_dir)
    except OSError as e:
        log.error("worker %s: KV folder: %s", wcfg.name, e)
        return EX_CONFIG
    try:
        engine = build_engine(model, vcfg, root)
        built.append(engine)
        set_title(f"batchyard::vllm-worker[{wcfg.name}]")  # in case vLLM named the process
        vocab = engine.model_config.get_vocab_size()
        t_cal = time.monotonic()
        cal = Calibrator(engine, vocab, model.max_model_len, seed=zlib.crc32(wcfg.name.encode()))
        prefill, decode = cal.run(vcfg.calibrate_tokens, STORE if vcfg.role == "prefill-cpu" else "")
        for ids in cal.prompts:  # what the calibration stored must not linger in the shared folder
            shutil.rmtree(kv_entry(root, ids, model.block_size), ignore_errors=True)
    except Exception:  # a model folder vLLM cannot load, a KV cache that does not fit: restarting won't help
        log.exception("worker %s: the vLLM engine for %r (%s) cannot start", wcfg.name, model.name, model.path)
        return EX_CONFIG
    log.info("worker %s: engine ready in %.1f s, calibrated in %.1f s: prefill %s, decode %s", wcfg.name,
             t_cal - started, time.monotonic() - t_cal,
             [(s.prompts, round(s.seconds * 1e3, 1)) for s in prefill], [(s, round(t * 1e3, 2)) for s, t in decode])
    engine_msg = P.LlmEngine(model=model.name, role=vcfg.role, stand_in=vcfg.stand_in, block_size=model.block_size,
                             max_model_len=model.max_model_len, max_num_seqs=vcfg.max_num_seqs,
                             prefill=prefill, decode=decode)
    return LlmServer(node, wcfg, engine, root, engine_msg, vocab, eos_token_ids(model.path)).serve(started)
