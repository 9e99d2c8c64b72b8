"""The worker process loop, shared by every executor.

A worker connects a DEALER (identity = its name) to the dispatcher's backend ROUTER,
registers after warm-up, then runs one batch message at a time. A heartbeat thread with its
own socket keeps the worker visibly alive while a long batch runs (the model releases the
GIL); it also relays the dispatcher's "reregister" (e.g. after a dispatcher restart), and on its
"restart" (a batch never came back: the model is stuck) ends the process for its supervisor to
start again. Asked to register again while an asynchronous executor (Triton's) still holds
batches sent before, the worker registers once they are done: the dispatcher that asks counts
none of them, and would send its own into slots they still hold.
Under systemd (``Type=notify``) the worker sends READY=1 once it has registered.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import secrets
import signal
import threading
import time
from typing import Callable

import numpy as np
import zmq

from batchyard import protocol as P
from batchyard.exit_codes import EX_SOFTWARE
from batchyard.protocol import Status
from batchyard.sd_notify import notify
from batchyard.shm import SegmentCache

from .batch_io import assemble, check_outputs, read_batch, write_results

log = logging.getLogger("batchyard.worker")
REGISTER_RETRY_S = 2.0
# Unanswered registrations after which the worker says so (and again every ten times as many):
# a worker whose name another connected worker has is dropped by the dispatcher's socket, unseen
# by both, and it waited for ever without a word.
UNANSWERED_WARN = 3
# Characters of a model exception's text that a reply carries: a 20 MB text made a 20 MB header.
ERROR_TEXT_MAX = 4096
HEARTBEAT_QUEUE = 4  # beats held for a dispatcher that is not reading


class Heartbeat(threading.Thread):
    def __init__(self, ctx: zmq.Context, backend: str, name: str, interval_s: float,
                 secure: Callable[[zmq.Socket], None] = lambda sock: None, wake: Callable[[], None] = lambda: None):
        super().__init__(name=f"heartbeat-{name}", daemon=True)
        self.wake = wake  # wakes the worker's loop for a `reregister`
        self.sock = ctx.socket(zmq.DEALER)
        secure(self.sock)
        self.sock.setsockopt(zmq.IDENTITY, f"{name}#hb".encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        # Beats queued for a dispatcher that is not reading are stale: when it reads again, one
        # is enough. A small queue makes the send below meet a full queue soon (handled there).
        self.sock.setsockopt(zmq.SNDHWM, HEARTBEAT_QUEUE)
        self.sock.connect(backend)
        self.msg = P.encode(P.Heartbeat(worker=name))
        self.interval_ms = int(interval_s * 1000)
        self.stop = threading.Event()
        self.reregister = threading.Event()
        # end() wakes the wait on the socket: a worker's stop otherwise waited up to one interval
        # for this thread (0.2 s by default).
        self._woken, self._wake = os.pipe()
        os.set_blocking(self._wake, False)

    def end(self, timeout: float = 2.0) -> None:
        """Stop beating, join the thread (at most ``timeout``), and close what it leaves: the
        socket of a thread never started (a context's term() waits for every socket)."""
        self.stop.set()
        if self._wake < 0:  # ended already
            return
        try:
            os.write(self._wake, b"x")
        except BlockingIOError:  # (a full pipe is woken already)
            pass
        if self.is_alive():
            self.join(timeout=timeout)
        elif self.ident is None:
            self.sock.close()
        if not self.is_alive():
            os.close(self._woken)
            os.close(self._wake)
            self._woken = self._wake = -1

    def run(self) -> None:
        next_beat = 0.0
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._woken, zmq.POLLIN)
        try:
            while not self.stop.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + self.interval_ms / 1000
                    try:
                        self.sock.send(self.msg, zmq.NOBLOCK)
                    except zmq.Again:
                        # The queue to a dispatcher that is not reading (stopped, restarting,
                        # starved) is full: skip this beat. Ending the thread here would leave a
                        # healthy worker silent for good once the dispatcher reads again.
                        pass
                # Waiting on the socket doubles as the heartbeat period, which an answer does not
                # cut short: beaten again at once, a restarted dispatcher's `reregister` drew the
                # next beat, whose `reregister` drew the next (hundreds in 40 ms).
                if self.sock in dict(poller.poll(max(0.0, next_beat - now) * 1000)):
                    msg = P.to_worker_decoder.decode(self.sock.recv())
                    if type(msg) is P.Reregister:
                        self.reregister.set()
                        self.wake()
                    elif type(msg) is P.Restart:
                        # The main thread is stuck in the model and cannot be asked to stop:
                        # leave at once, so that the supervisor starts a working process.
                        log.error("worker %s exits to be started again: the dispatcher declared it hung (%s)",
                                  msg.worker, msg.reason)
                        for h in logging.getLogger().handlers:
                            h.flush()
                        os._exit(EX_SOFTWARE)
        except zmq.ZMQError:
            pass
        finally:
            self.sock.close()


class WorkerRuntime:
    def __init__(self, name: str, backend: str, executor, specs: dict[str, P.ModelSpec],
                 heartbeat_interval_s: float = 0.2, max_inflight: int = 1, numa_node: int = -1,
                 secure: Callable[[zmq.Socket], None] = lambda sock: None):
        self.name = name
        self.started = secrets.token_hex(8)  # Register.started
        self.secure = secure  # CURVE keys for a tcp backend (batchyard.transport.secure_worker_socket)
        self.backend = backend
        self.executor = executor
        self.specs = specs
        self.heartbeat_interval_s = heartbeat_interval_s
        self.max_inflight = max_inflight
        self.numa_node = numa_node
        self.cache = SegmentCache()
        self._sizes_run: set = set()  # (model, batch size) run in this process (warm-up included)
        self._stop = False
        # Completions of asynchronous executors (k batches in flight): appended on their
        # threads, drained by the loop, which a byte on this pipe wakes.
        self._completed: collections.deque = collections.deque()
        # Each batch an asynchronous executor holds, not yet completed, counts under the registration
        # it came in (`_term`: how many times the worker was asked to register again); those of an
        # earlier one hold the next registration.
        self._term = 0
        self._by_term: collections.Counter = collections.Counter()
        self._hold_until = 0.0
        # How long a registration waits for them: a batch, then one of its requests run alone (a
        # batch the model failed), each ended by the executor's own timeout (Triton's gRPC calls).
        self.hold_max_s = 2 * getattr(executor, "timeout_s", 30.0)
        # Wakes the loop: a completion, a stop, a `reregister`. Written without blocking (from a
        # signal handler too): a full pipe has a wake-up pending already.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        if hasattr(executor, "stopping"):  # one that may wait on this thread stops waiting on a stop
            executor.stopping = lambda: self._stop

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):  # full (a wake-up is pending), or closed at the end
            pass

    def request_stop(self, *_args) -> None:
        self._stop = True
        # Heard now, not at the loop's next timer (an idle worker polled every 200 ms for it)
        self._wake()
        exit_after_grace()

    def warmup(self, sizes: dict[str, tuple[int, ...]]) -> None:
        """Run every batch size the scheduler may use once: oneDNN builds kernels per shape and
        the first call at a new size measured 25-35 % slower (once 919 ms)."""
        for model, spec in self.specs.items():
            for b in sizes.get(model) or powers_of_two(spec.max_batch):
                self._sizes_run.add((model, b))
                inputs = {t.name: np.zeros((b, *t.shape), dtype=t.dtype) for t in spec.inputs}
                t0 = time.perf_counter()
                try:
                    self.executor.run(model, inputs)
                except ExecutorUnavailable:
                    raise  # its backend (Triton) is not up yet: a restart may find it
                except Exception as e:  # noqa: BLE001 -- a restart runs the same code on the same zeros: EX_CONFIG
                    if out_of_memory(e):
                        raise
                    if getattr(e, "restart_may_help", False):
                        # The model runs in another process (Triton's), whose error may pass: exit
                        # 69, restarted. As 78 a Triton stub that crashed once kept its worker down
                        # for good, Triton fixed or not.
                        raise ExecutorUnavailable(f"[[models]] {model!r}: warm-up at B={b}: {error_text(e)}") from None
                    # (a model whose layers do not fit its spec raised a traceback and exit 1, which
                    # systemd restarts for ever)
                    from .executors import ModelContractError

                    what = str(e) if isinstance(e, ModelContractError) else error_text(e)
                    raise CannotStart(f"[[models]] {model!r}: warm-up at B={b}: {what}") from None
                log.info("warm-up %s B=%d: %.1f ms", model, b, (time.perf_counter() - t0) * 1e3)

    def _register_msg(self) -> bytes:
        return P.encode(P.Register(v=P.PROTOCOL_VERSION, worker=self.name, pid=os.getpid(),
                                   path=self.executor.path, models=list(self.specs.values()),
                                   max_inflight=self.max_inflight, numa_node=self.numa_node,
                                   simulated=self.executor.simulated, started=self.started,
                                   batch_bound_s=getattr(self.executor, "batch_bound_s", 0.0)))

    def serve(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # SIGHUP: it died with its batch
            signal.signal(sig, self.request_stop)
        # The signal's byte reaches the pipe at once, also one that comes just before the loop's
        # poll starts (the handler, run between bytecodes, would set the flag too late for it).
        signal.set_wakeup_fd(self._wake_w)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.name.encode())
        self.secure(sock)
        sock.connect(self.backend)
        hb = Heartbeat(ctx, self.backend, self.name, self.heartbeat_interval_s, self.secure, self._wake)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        registered = False
        # Ever registered on this socket: a registration held back for earlier batches (a
        # `reregister`) still owes the dispatcher its `leaving` and `goodbye` on a stop; one that
        # knows the worker kept it in rotation until worker_dead_after_s, and sent it batches
        # that were lost. A dispatcher that does not know it answers `leaving` and drops `goodbye`.
        announced = False
        next_register = next_sweep = 0.0
        # The dispatcher said it is closing (`closing`): no registration is sent until a dispatcher
        # asks for one (`reregister`), and nothing is owed to the one that closed.
        closed = False
        unanswered = 0  # registrations sent since the last answer
        first_unanswered = 0.0  # when the first of them was sent
        rc = 0
        try:
            while not self._stop:
                now = time.monotonic()
                if hb.reregister.is_set():
                    hb.reregister.clear()
                    closed = False
                    if registered:  # at once; one already sent and unanswered keeps its retry
                        next_register = 0.0
                    registered = self._asked_to_register_again(registered, now)
                if not registered and not closed and now >= next_register and not self._holds_earlier_batches(now):
                    sock.send(self._register_msg())
                    next_register = now + REGISTER_RETRY_S
                    if not unanswered:
                        first_unanswered = now
                    unanswered += 1
                    if unanswered % (10 * UNANSWERED_WARN) == UNANSWERED_WARN:
                        log.warning("worker %s: %d registrations with the dispatcher at %s unanswered in %.0f s: "
                                    "is it running, with the CURVE keys this worker has? Is another worker named "
                                    "%r connected to it? (its socket drops a second connection of one name)",
                                    self.name, unanswered, self.backend, now - first_unanswered, self.name)
                # Until the next timed step (the sweep, a registration's retry, the end of its hold);
                # batches, completions, a stop and a `reregister` wake it before that.
                due = next_sweep
                if not registered and not closed:
                    due = min(due, max(next_register, self._hold_until) if self._in_executor else next_register)
                events = dict(poller.poll(max(0.0, due - now) * 1000))
                if now >= next_sweep:  # at most once a second (an fstat per segment held), idle too:
                    # swept only after a batch, a departed client's segments stayed held by an idle
                    # worker, and in a 64 MiB /dev/shm (Docker's) the next client's pool had no room
                    next_sweep = now + 1.0
                    self.cache.drop_unlinked()
                if self._wake_r in events:
                    os.read(self._wake_r, 4096)
                self._send_completed(sock)
                if sock not in events:
                    continue
                frames = sock.recv_multipart(copy=False)
                msg = P.to_worker_decoder.decode(frames[0].buffer)
                if type(msg) is P.Batch:
                    self._run_and_reply(sock, msg, frames)
                elif type(msg) is P.Registered:
                    unanswered = 0
                    if not registered:
                        log.info("worker %s registered with the dispatcher", self.name)
                        notify("READY=1")  # systemd's Type=notify: taking traffic now
                    registered = announced = True
                    if not hb.is_alive() and not hb.stop.is_set():
                        hb.start()
                elif type(msg) is P.Reregister:
                    closed = False
                    registered, next_register = self._asked_to_register_again(registered, now), 0.0
                elif type(msg) is P.Closing:
                    log.info("worker %s: the dispatcher is closing; registering again when one asks", self.name)
                    registered = announced = False
                    closed = True
                elif type(msg) is P.RegisterRejected:
                    log.error("dispatcher rejected worker %s: %s", self.name, msg.message)
                    rc = 2
                    break
            if not announced and unanswered and rc == 0:
                announced = self._registered_on_stop(sock)
            if self._in_executor or announced:
                # Registered, a batch the dispatcher sent before it knew of the stop may be in the
                # socket (max_inflight > 1: one behind the one running): left there, the dispatcher
                # took it for a batch the worker died running, spent its requests' retry and ran
                # them as suspects, alone.
                announced = self._finish_in_flight(sock, poller, announced)
        finally:
            if announced:
                sock.send(P.encode(P.Goodbye(worker=self.name)), zmq.NOBLOCK)
            hb.end()  # (closes the socket of one never started: ctx.term() below waited for it for ever)
            # Lingering only for a dispatcher owed the goodbye: what else is queued (a registration
            # nobody answered, a batch's answer for a dispatcher that said `closing`) is for
            # nobody, and lingering for it held the stop 0.5 s.
            sock.close(linger=LINGER_MS if announced else 0)
            self.cache.close()
            close = getattr(self.executor, "close", None)
            if close is not None:
                close()
            os.close(self._wake_r)
            # (-1 first: a stop signal after this must not write into a file that reuses the number)
            signal.set_wakeup_fd(-1)
            wake_w, self._wake_w = self._wake_w, -1
            os.close(wake_w)
            ctx.term()
        return rc

    def _asked_to_register_again(self, registered: bool, now: float) -> bool:
        """The dispatcher does not know this worker (it restarted, or declared it dead): none of
        the batches the executor holds count there. Registered at once, the worker got as many
        new batches as it has slots, and those found no free slot: they failed UNAVAILABLE, and the
        dispatcher's breaker took the worker out of rotation, until the old batches ended seconds
        later. So the registration waits for them, at most ``hold_max_s``: each ends within the
        executor's own timeout, and a lost completion must not keep the worker out for good. (A
        `reregister` answering a heartbeat sent just before the registration may come after it:
        then the wait is for batches the dispatcher does count, each already running.)
        Returns the new ``registered``."""
        self._term += 1
        held = self._in_executor
        if registered and held:
            self._hold_until = now + self.hold_max_s
            log.info("worker %s registers again once the %d batch(es) its executor holds are done", self.name, held)
        return False

    @property
    def _in_executor(self) -> int:
        """Batches an asynchronous executor holds, not yet completed."""
        return sum(self._by_term.values())

    def _holds_earlier_batches(self, now: float) -> bool:
        return now < self._hold_until and any(n for term, n in self._by_term.items() if term < self._term)

    def _send_completed(self, sock) -> None:
        while self._completed:  # batches an asynchronous executor finished
            then, raw, compute_us, end_ns, term = self._completed.popleft()
            self._by_term[term] -= 1
            if not self._by_term[term]:
                del self._by_term[term]
            reply = then(raw, compute_us, end_ns)
            if reply is not None:
                sock.send_multipart(reply, copy=False)

    def _registered_on_stop(self, sock) -> bool:
        """A stop that came with a registration unanswered: whether the dispatcher's answer was
        on its way (it registered this worker, and may have sent batches right behind it, which
        are run here). Gone at once, the worker left them unanswered, and the dispatcher took
        them for batches it died running: under load, a SIGTERM just after `registered` was sent
        made the worker exit 0 with nothing said (tests/test_failures.py::
        test_a_worker_stopped_with_a_second_batch_queued_answers_both, 2 runs in 6)."""
        registered = False
        while sock.poll(0 if registered else REGISTERED_ON_STOP_WAIT_MS):
            frames = sock.recv_multipart(copy=False)
            msg = P.to_worker_decoder.decode(frames[0].buffer)
            if type(msg) is P.Registered:
                registered = True
            elif type(msg) is P.Batch and registered:
                self._run_and_reply(sock, msg, frames)
        return registered

    def _finish_in_flight(self, sock, poller, announced: bool) -> bool:
        """Stopping with batches in an asynchronous executor (Triton): their replies go out
        before the goodbye. Gone without them, the dispatcher ran their requests again, and one
        that had spent its retry failed UNAVAILABLE. The dispatcher is told first (``leaving``)
        to send no new batch; one it sent before it knew is run too. exit_after_grace bounds
        the wait. Returns whether the dispatcher is still owed a ``goodbye`` (not after its
        ``closing``: it has gone)."""
        if self._in_executor:
            log.info("worker %s stopping: waiting for %d batch(es) in flight", self.name, self._in_executor)
        noted = not announced  # the dispatcher's answer to `leaving`: no batch comes after it
        if announced:
            sock.send(P.encode(P.Leaving(worker=self.name)))
        start = time.monotonic()
        deadline = start + STOP_GRACE_S - 1.0
        # The answer to `leaving` comes within milliseconds from a dispatcher that is there; one
        # that is gone (stopping beside this worker) never sends it: waited for up to the whole
        # grace, an idle worker took 15 s to stop. Only batches in the executor are worth that.
        # Not scaled with the heartbeat: at 3x a 4 s heartbeat the wait outlasted `up`'s 10 s stop
        # bound (the dispatcher stops first now), and `up` killed the workers.
        noted_by = start + LEAVING_NOTED_WAIT_S
        while (self._in_executor or (not noted and time.monotonic() < noted_by)) and time.monotonic() < deadline:
            until = deadline if self._in_executor else min(deadline, noted_by)
            events = dict(poller.poll(max(0.0, until - time.monotonic()) * 1000))
            if self._wake_r in events:
                os.read(self._wake_r, 4096)
            self._send_completed(sock)
            while sock in events and sock.poll(0):
                frames = sock.recv_multipart(copy=False)
                msg = P.to_worker_decoder.decode(frames[0].buffer)
                if type(msg) is P.LeavingNoted:
                    noted = True
                elif type(msg) is P.Closing:  # read only now (the stop came first): nobody answers
                    noted, announced = True, False
                elif type(msg) is P.Batch:
                    self._run_and_reply(sock, msg, frames)
        return announced

    def _run_and_reply(self, sock, msg: P.Batch, frames: list) -> None:
        """Run a batch from the socket (``frames``: its header first); its reply goes out now,
        or from the loop when an asynchronous executor calls back."""
        out = self.run_batch(msg, frames[1:])
        if out is not None:
            sock.send_multipart(out, copy=False)

    def run_batch(self, msg: P.Batch, frames: list) -> list | None:
        """Run one batch. Returns the reply frames, or None when an asynchronous executor
        took it (its reply is sent from the loop when the executor calls back)."""
        spec = self.specs.get(msg.model)
        items = read_batch(msg, frames, self.cache)
        n_items = sum(it.items for it in items if it.error is None)
        if spec is None:
            err = (Status.UNKNOWN_MODEL, f"worker {self.name} does not serve {msg.model!r}")
            return self._finish(msg, items, spec, None, 0, err)
        if not n_items:
            return self._finish(msg, items, spec, None, 0, None)
        try:
            inputs = assemble(items, spec, self.cache)
        except Exception as e:
            return self._finish(msg, items, spec, None, 0, (Status.INTERNAL, f"assembling inputs: {e}"))
        if not any(it.error is None for it in items):  # every segment came up short
            return self._finish(msg, items, spec, None, 0, None)
        n_items = sum(it.items for it in items if it.error is None)  # after assemble's checks
        first = (msg.model, n_items) not in self._sizes_run and not self.executor.simulated
        self._sizes_run.add((msg.model, n_items))
        if getattr(self.executor, "submit", None) is not None:
            self._submit(msg.model, inputs, functools.partial(self._submitted_done, msg, items, spec, first,
                                                              self._term, True), self._term)
            return None
        t0 = time.perf_counter()  # (CLOCK_MONOTONIC, as the dispatcher's and front door's clocks)
        try:
            raw = self.executor.run(msg.model, inputs)
        except ExecutorUnavailable as e:
            raw = e
        except BaseException as e:  # noqa: BLE001
            # Whatever the model raises is its failure, SystemExit and KeyboardInterrupt too: caught
            # as Exception only, a model's sys.exit(3) ended the worker twice (the batch, then the
            # request's lone retry), the request failed UNAVAILABLE, and a sys.exit(78) marked the
            # worker misconfigured for good. No stop of the worker's own raises into the model:
            # SIGTERM and SIGINT set a flag (request_stop); `restart` and the grace use os._exit.
            raw = self._each_alone(msg.model, items, spec, e)
            # Nothing to learn from it: the time is the failed batch's plus the lone runs'.
            return self._finish(msg, items, spec, raw, 0, None)
        t1 = time.perf_counter()
        return self._finish(msg, items, spec, raw, int((t1 - t0) * 1e6), None, first, int(t1 * 1e9))

    def _submit(self, model: str, inputs: dict, then, term: int) -> None:
        """Hand a batch to an asynchronous executor; ``then(raw, compute_us, end_ns)`` runs on the loop when
        it completes and returns the reply frames, or None when there is none to send yet.
        ``term``: the registration its batch came in."""
        def done(raw, compute_us):
            # Runs on the executor's thread: hand over to the loop, never touch the socket here.
            self._completed.append((then, raw, compute_us, time.monotonic_ns(), term))
            self._wake()

        self._by_term[term] += 1
        self.executor.submit(model, inputs, done)

    def _submitted_done(self, msg: P.Batch, items: list, spec, first: bool, term: int, again: bool, raw,
                        compute_us: int, end_ns: int = 0) -> list | None:
        """A batch the asynchronous executor completed. One the model failed runs again one
        request at a time, as ``_each_alone`` does for the others: one request Triton refused
        failed every client's request batched with it. One to send again (SendAgain) is
        submitted ``again``, once: the first batch after Triton restarted while this worker was
        idle failed UNAVAILABLE, with no other worker to take it."""
        if again and isinstance(raw, SendAgain):
            try:  # (assembled anew: the cache the first assembly used may hold a later batch's by now)
                inputs = assemble(items, spec, self.cache)
            except Exception as e:  # on the loop: raised here, it ended the worker
                return self._finish(msg, items, spec, None, 0, (Status.INTERNAL, f"assembling inputs: {e}"))
            self._submit(msg.model, inputs, functools.partial(self._submitted_done, msg, items, spec, first, term,
                                                              False), term)
            return None
        if isinstance(raw, Exception) and not isinstance(raw, ExecutorUnavailable):
            good = [it for it in items if it.error is None]
            if len(good) >= 2:
                return self._next_alone(_LoneRuns(msg, items, spec, raw, good, term))
        return self._finish(msg, items, spec, raw, compute_us, None, first, end_ns)

    def _next_alone(self, runs: "_LoneRuns") -> list | None:
        """Submit the next request of ``runs`` alone (one at a time: the failed batch's slot in
        the executor is the one free for them); with none left, the batch's reply."""
        while runs.todo:
            it = runs.todo.pop(0)
            try:
                inputs = assemble([it], runs.spec, self.cache)
            except Exception as e:  # on the loop: raised here, it ended the worker
                runs.failed.append((it, e))
                continue
            self._submit(runs.msg.model, inputs, functools.partial(self._alone_done, runs, it, True), runs.term)
            return None
        raw = self._alone_outcome(runs.msg.model, runs.spec, runs.good, runs.outs, runs.failed, runs.batch_failure)
        # Nothing to learn from it: the time is the failed batch's plus the lone runs'.
        return self._finish(runs.msg, runs.items, runs.spec, raw, 0, None)

    def _alone_done(self, runs: "_LoneRuns", it, again: bool, raw, compute_us: int,
                    end_ns: int = 0) -> list | None:
        if again and isinstance(raw, SendAgain):  # once, as a batch is (_submitted_done)
            try:
                inputs = assemble([it], runs.spec, self.cache)
            except Exception as e:
                raw = e
            else:
                self._submit(runs.msg.model, inputs, functools.partial(self._alone_done, runs, it, False), runs.term)
                return None
        if not isinstance(raw, BaseException):
            try:
                runs.outs.append(check_outputs(raw, runs.spec, it.items))
            except Exception as e:
                raw = e
        if isinstance(raw, BaseException):  # this request's own failure (or the backend's)
            runs.failed.append((it, raw))
            if isinstance(raw, ExecutorUnavailable):
                runs.todo.clear()  # then the batch fails as a whole (_alone_outcome): the rest need not run
        return self._next_alone(runs)

    def _each_alone(self, model: str, items: list, spec, batch_failure: Exception):
        """The batch raised: run each of its requests alone, so that only the ones the model fails
        on by themselves fail (INVALID_ARGUMENT, the model's words), not every client whose request
        shared the batch with them (one out-of-vocabulary token id failed them all). Returns the
        outputs of the rest, or ``batch_failure`` when every request fails alone too: then the
        model, not an input, is at fault. For executors that run a batch in the call (``submit``
        ones reply later, from their own thread: ``_submitted_done``)."""
        good = [it for it in items if it.error is None]
        if len(good) < 2:
            return batch_failure
        outs, failed = [], []
        for it in good:
            try:
                inputs = assemble([it], spec, self.cache)
                outs.append(check_outputs(self.executor.run(model, inputs), spec, it.items))
            except BaseException as e:  # noqa: BLE001 -- its own failure (as in run_batch), or the backend's
                failed.append((it, e))
        return self._alone_outcome(model, spec, good, outs, failed, batch_failure)

    @staticmethod
    def _alone_outcome(model: str, spec, good: list, outs: list, failed: list, batch_failure: Exception):
        """What a failed batch whose requests ran alone gets: the outputs of those that ran (the
        others fail INVALID_ARGUMENT); ``batch_failure`` when all failed; the backend's failure
        when it failed meanwhile (UNAVAILABLE: another worker may take them; as the model's error,
        INTERNAL, the dispatcher failed every request of the batch for good)."""
        down = next((e for _, e in failed if isinstance(e, ExecutorUnavailable)), None)
        if down is not None:
            return down
        if len(failed) == len(good):
            return batch_failure
        for it, e in failed:
            it.error = (Status.INVALID_ARGUMENT, f"model {model!r} failed on this request: {error_text(e)}")
        log.warning("batch of %s failed (%s); run alone, %d of its %d requests failed", model,
                    error_text(batch_failure), len(failed), len(good))
        return {t.name: np.concatenate([o[t.name] for o in outs]) for t in spec.outputs}

    def _finish(self, msg: P.Batch, items, spec, raw, compute_us: int, batch_error, first: bool = False,
                compute_end_ns: int = 0) -> list:
        outputs = None
        if isinstance(raw, BaseException):
            if isinstance(raw, ExecutorUnavailable):
                batch_error = (Status.UNAVAILABLE, str(raw))
            else:  # a model failure fails this batch, never the worker
                what = error_text(raw)
                log.error("batch %d of %s failed: %s", msg.batch_id, msg.model, what)
                batch_error = (Status.INTERNAL, f"model {msg.model!r} raised {what}")
            compute_us = 0
        elif raw is not None:
            try:
                outputs = check_outputs(raw, spec, sum(it.items for it in items if it.error is None))
            except ValueError as e:
                batch_error, compute_us = (Status.INTERNAL, f"model {msg.model!r}: {e}"), 0
        results, out_frames = write_results(items, outputs, batch_error, self.cache, spec)
        header = P.encode(P.BatchDone(batch_id=msg.batch_id, worker=self.name, compute_us=compute_us,
                                      results=results, first_of_size=first,
                                      compute_end_ns=compute_end_ns if compute_us else 0))
        return [header, *out_frames]


# A stop asked (SIGTERM: from `up`, from systemd, or the parent-death signal when `up` was killed
# hard) is read by the loop between batches; a batch that never ends would keep the process for
# good (an orphan, its memory held). Past `up`'s own stop timeout (10 s, then SIGKILL) it exits.
STOP_GRACE_S = 15.0
LINGER_MS = 500  # how long the worker's socket, closed, keeps sending its `goodbye`
LEAVING_NOTED_WAIT_S = 1.0  # an idle stopping worker's wait for the dispatcher's `leaving_noted`
# A worker stopped with its registration unanswered waits this long for the answer (a dispatcher
# that is there answers within milliseconds; one that is not costs the stop this much).
REGISTERED_ON_STOP_WAIT_MS = 100


def out_of_memory(e: BaseException) -> bool:
    """Memory a killed predecessor held may not be free yet (a GPU's): a restart may find it, so
    such a failure at start exits 1, restarted, not 78 (EX_CONFIG), never restarted."""
    return isinstance(e, MemoryError) or "OutOfMemory" in type(e).__name__


def error_text(e: BaseException, typed: bool = True) -> str:
    """``Type: text`` of a model's exception, as a reply header can carry it. The text is the
    model's: one whose ``__str__`` raised, or that held a lone surrogate (``os.fsdecode`` of a
    non-UTF-8 path), raised while the reply was built or encoded, outside any handler, and the
    worker died with its batch, twice (the batch, then the request's lone retry)."""
    try:
        text = str(e)
    except Exception:
        text = "(its text could not be read)"
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) > ERROR_TEXT_MAX:
        text = f"{text[:ERROR_TEXT_MAX]}... ({len(text)} characters)"
    return f"{type(e).__name__}: {text}" if typed else text


def exit_after_grace() -> None:
    timer = threading.Timer(STOP_GRACE_S, os._exit, (1,))
    timer.daemon = True
    timer.start()


class _LoneRuns:
    """A batch an asynchronous executor failed, its requests being run again one at a time."""

    def __init__(self, msg: P.Batch, items: list, spec, batch_failure: Exception, good: list, term: int):
        self.msg, self.items, self.spec, self.batch_failure = msg, items, spec, batch_failure
        self.term = term  # the registration the batch came in: its lone runs count under it too
        self.good, self.todo = good, list(good)
        self.outs: list = []
        self.failed: list = []


class CannotStart(RuntimeError):
    """This worker cannot run on this host or against this backend as configured (no GPU, a
    Triton model that does not match the spec, ...). Restarting would not help: the worker
    exits with EX_CONFIG and neither `batchyard up` nor systemd restarts it."""


class ExecutorUnavailable(Exception):
    """The executor's backend (e.g. a Triton server) cannot be reached: the batch's requests
    get UNAVAILABLE, not INTERNAL, and the worker stays up."""


class SendAgain(ExecutorUnavailable):
    """The batch failed for a cause the executor has already set right for its next call (a
    restarted Triton that lost this worker's regions, refused before it ran any of it; a call cut
    by the reconnect that followed): the runtime submits it once more. (A model's run is a pure
    function of its inputs: one that did run, its outputs left in a held slot, runs again.)"""


def powers_of_two(max_batch: int) -> tuple[int, ...]:
    """Batch sizes 1, 2, 4, ... below ``max_batch``, and ``max_batch``: the default warm-up,
    calibration and CUDA graph sizes."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    sizes.append(max_batch)
    return tuple(sizes)
