"""``batchyard up``: start a node's dispatcher and workers, wait until ready, restart workers
that die or hang, and stop everything cleanly on SIGTERM/SIGINT/SIGHUP.

Children are plain processes (``python -m batchyard.cli ...``) so that systemd units can run
exactly the same commands one by one. Each child gets PR_SET_PDEATHSIG so that nothing
outlives a supervisor that was killed hard. Waiting is on signals (sigtimedwait on SIGCHLD,
SIGTERM, SIGINT, SIGHUP), never a polling loop: `up` learns that a child died from the kernel
(SIGCHLD, then waitpid), never from a missing heartbeat, so a starved machine cannot make it
restart a healthy worker.

A child that hangs without dying is ended by `up` too. A worker: the dispatcher takes one it
no longer hears out of rotation, and `up` (told by a status long poll, ``LostWorkers``) kills
it once it has stayed out worker_dead_after_s (LOST_WORKER_GRACE_MIN_S at least) without
registering again. The dispatcher and the front doors: each gets a socket of `up`'s own as
NOTIFY_SOCKET, with WATCHDOG_USEC, and pings it from its event loop as it would ping systemd
(``ChildNotifications``); one silent for that long is aborted (SIGABRT, then SIGKILL). A front door is started again; without its
dispatcher the node stops and `up` exits 1, for systemd to restart it.

Under systemd (``Type=notify``) `up` sends READY=1 once every worker has registered and
every front-door process serves its ports (each says READY=1 on `up`'s socket once its
ports are bound: how `up` knows that a client may connect, not a port probe), and WATCHDOG=1
from its wait loop. The children's watchdog period is `up`'s own WatchdogSec, or
CHILD_WATCHDOG_S without one.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import math
import os
import secrets
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional, TypeVar

from .exit_codes import EX_CONFIG, EX_SOFTWARE
from .config import SNAPSHOT_HEADER, NodeConfig, to_toml
from .private_tmp import PrivateDir
from .sd_notify import child_env, notify, watchdog_interval_s
from .transport import node_client_keys

log = logging.getLogger("batchyard.up")
T = TypeVar("T")
FRONTEND_NAME = "frontend#"  # '#' is not allowed in worker names
_PR_SET_PDEATHSIG = 1
# SIGHUP too: a closed terminal or a session's end stopped `up` by the default action, leaving
# its children to PR_SET_PDEATHSIG, with no drain and no cleanup.
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
RESTART_BACKOFF_MAX_S = 10.0
# A child that ran this long since its start has its restarts in a row forgotten: its next death
# is restarted at once. One that dies sooner is restarted after a back-off doubling from 0.5 s
# to RESTART_BACKOFF_MAX_S. (Counted from 5 s, a model that loads for longer, as real ones do,
# and then died at its first batch was restarted at once for ever: 9 restarts a minute, each
# loading its weights again; an outside review.)
RESTART_STABLE_S = 60.0
STOP_TIMEOUT_S = 10.0  # for each group of children in turn: front doors, the dispatcher, workers
# The dispatcher's stop waits at least its drain_timeout_s plus this (SIGKILL cut a longer drain).
DRAIN_MARGIN_S = 5.0
READY_TIMEOUT_S = 300.0  # deploy/systemd/batchyard-node@.service's TimeoutStartSec must exceed it
# One readiness long poll: answered the moment the n-th worker registers; the cap bounds how
# late a child that died during start-up is noticed.
READY_POLL_S = 1.0
# After a failed readiness poll (a dispatcher still starting, or too starved to answer in
# time), wait this long (doubling up to READY_POLL_S) before the next; a child's death ends the
# wait at once.
READY_RETRY_S = 0.05
# How long past its long-poll window one readiness poll may wait for the reply.
READY_REPLY_S = 5.0
# A worker out of rotation this long (at least; worker_dead_after_s where longer) without
# registering again is hung. Not less: on a starved host a healthy worker, dropped for a late
# heartbeat, registers again only after its batch in progress.
LOST_WORKER_GRACE_MIN_S = 5.0
# While every worker is registered, one status long poll waits this long for a departure.
LOST_POLL_S = 60.0
# The dispatcher's and front doors' watchdog period without systemd's WatchdogSec (systemd's
# units use 30 s); never under CHILD_WATCHDOG_MIN_S, which a starved host's loop may need.
CHILD_WATCHDOG_S = 30.0
CHILD_WATCHDOG_MIN_S = 2.0
# After SIGABRT (systemd's watchdog signal, a core dump), how long a hung child has until SIGKILL:
# a stopped process (SIGSTOP) takes no other signal.
CHILD_ABORT_GRACE_S = 5.0


class NodeNotReady(RuntimeError):
    """The node did not become ready: a child exited during start-up, or the readiness polls
    kept failing until the start timeout. ``exit_code``: `up`'s, EX_CONFIG when a child said
    the config cannot run on this host (systemd's RestartPreventExitStatus then holds)."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


def _die_with_parent() -> None:
    """Runs in the child between fork and exec."""
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    # A worker restarted from run_forever would inherit the supervisor's blocked signals (the
    # mask survives exec) and ignore SIGTERM: unblock them for the child.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS | {signal.SIGCHLD, signal.SIGIO})


def start_without_signals(start: Callable[[], T]) -> T:
    """``start()`` (which starts threads) with every signal blocked: a thread takes its
    creator's mask, and `up`'s main thread must be the only one a stop signal can reach. One
    let in by another thread (the readiness poll's client I/O thread, still exiting as `up`
    says ready) only flags Python's handler for the main thread, which may be in sigwaitinfo
    already: that does not look at the flag, and `up` would ignore the SIGTERM for good."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        return start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def child_watchdog_s(env=os.environ) -> float:
    """The watchdog period of `up`'s dispatcher and front doors: `up`'s own under systemd
    (WatchdogSec=), so a child hung that long is ended by `up` (which goes on pinging systemd),
    otherwise CHILD_WATCHDOG_S; at least CHILD_WATCHDOG_MIN_S."""
    interval = watchdog_interval_s(env)
    return max(CHILD_WATCHDOG_MIN_S, 2 * interval if interval is not None else CHILD_WATCHDOG_S)


# fcntl(2), Linux: F_SETOWN_EX with an f_owner_ex of type F_OWNER_TID (the fcntl module lacks them)
_F_SETOWN_EX, _F_OWNER_TID = 15, 0


class ChildNotifications:
    """The sd_notify datagrams of the dispatcher and the front-door processes, on a socket of
    `up`'s own that they get as NOTIFY_SOCKET (sd_notify's protocol, so the same process under
    systemd tells systemd): READY=1 once a front door's ports are bound, WATCHDOG=1 from each
    event loop. The kernel stamps each datagram with its sender's pid (SO_PASSCRED), and only
    the pids of this `up`'s children count: the socket's abstract name is visible to every
    process of the network namespace."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        name = f"batchyard-up-{os.getpid()}-{secrets.token_hex(6)}"
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind("\0" + name)
        self.address = "@" + name  # NOTIFY_SOCKET's spelling of an abstract name
        # pid -> when its last READY=1 or WATCHDOG=1 was taken: the children that said they serve,
        # watched from then on, as systemd arms a unit's watchdog once it has started.
        self.alive_at: dict[int, float] = {}
        self._lock = threading.Lock()  # receive() runs on the start-up reader thread too
        self._received = threading.Condition(self._lock)
        self._reader: Optional[threading.Thread] = None
        self._stop_reader: Optional[tuple[int, int]] = None  # a pipe: its write end ends the reader

    def receive(self) -> None:
        """Take every datagram waiting (never blocks); remember the senders that said READY=1
        and when each last said READY=1 or WATCHDOG=1. Taken before each look at the children,
        so a ping's time is at worst later than it was sent, never earlier. A front door sends
        WATCHDOG=1 only once it serves (``announce_ready``), so one counts as its READY=1 too:
        that one datagram may have been dropped from a full queue."""
        creds = struct.calcsize("3i")
        with self._lock:
            while True:
                try:
                    data, anc, _flags, _addr = self.sock.recvmsg(4096, socket.CMSG_SPACE(creds))
                except (BlockingIOError, InterruptedError):
                    self._received.notify_all()
                    return
                pid = next((struct.unpack("3i", d[:creds])[0] for level, kind, d in anc
                            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS), None)
                if pid is None:
                    continue
                lines = data.split(b"\n")
                if b"READY=1" in lines or b"WATCHDOG=1" in lines:
                    self.alive_at[pid] = time.monotonic()

    def ready_among(self, pids: set[int]) -> set[int]:
        with self._lock:
            return pids & self.alive_at.keys()

    def read_in_background(self) -> None:
        """Take the datagrams as they come, on a thread of its own, until ``stop_reading``: during
        start-up `up` waits on the dispatcher's replies, up to a second at a time, and the
        socket queues at most net.unix.max_dgram_qlen datagrams (10 by default): five or more
        front doors, each sending READY=1 and WATCHDOG=1 at once, overflowed it; the dropped
        READY=1 was never sent again, and `up` gave up on a node whose every port served. The
        thread is started with every signal blocked: SIGCHLD and the stop signals must reach
        the main thread, which waits on them."""
        r, w = os.pipe2(os.O_CLOEXEC)
        self._stop_reader = (r, w)

        def read() -> None:
            while True:
                ready, _, _ = select.select([self.sock, r], [], [])
                if r in ready:
                    return
                self.receive()

        self._reader = threading.Thread(target=read, name="child-notifications", daemon=True)
        start_without_signals(self._reader.start)

    def stop_reading(self) -> None:
        """End the start-up reader (the main loop reads from here on, told by SIGIO)."""
        if self._reader is None:
            return
        r, w = self._stop_reader
        os.write(w, b"x")
        self._reader.join()
        os.close(r)
        os.close(w)
        self._reader = self._stop_reader = None

    def wait(self, seconds: float) -> None:
        """Block until a datagram arrives or ``seconds`` pass, then take what came (or, while the
        start-up reader runs, until it has taken some)."""
        if self._reader is not None:
            with self._received:
                self._received.wait(seconds)
            return
        select.select([self.sock], [], [], seconds)
        self.receive()

    def raise_sigio(self, on: bool) -> None:
        """Each datagram that arrives raises SIGIO at the calling thread (O_ASYNC), for a loop
        that waits on signals there: the socket queues at most net.unix.max_dgram_qlen datagrams
        (10 by default), and read only when the loop woke for its own reasons, the pings of 11 or
        more children overflowed it, were dropped, and healthy front doors were aborted as hung.
        At the thread, not the process: a process-directed SIGIO went to any thread that did not
        block it (one started before the mask), and the loop never saw it."""
        if on:
            owner = struct.pack("ii", _F_OWNER_TID, threading.get_native_id())
            fcntl.fcntl(self.sock, _F_SETOWN_EX, owner)
        flags = fcntl.fcntl(self.sock, fcntl.F_GETFL)
        fcntl.fcntl(self.sock, fcntl.F_SETFL, flags | os.O_ASYNC if on else flags & ~os.O_ASYNC)

    def forget(self, pid: int) -> None:
        with self._lock:
            self.alive_at.pop(pid, None)

    def close(self) -> None:
        self.stop_reading()
        self.sock.close()


class LostWorkers:
    """Which of `up`'s workers the dispatcher took out of rotation and has not seen register
    again, learned from status long polls on a thread of their own (the main thread waits on
    signals; each answer that finds a worker lost wakes it with a SIGCHLD).

    A hung worker (stopped, or a model holding the GIL) stops heartbeating and the dispatcher
    drops it, but tells it to exit only in reply to a heartbeat, which it never sends: `up`
    must end it. A pid counts only once it was seen registered, so a worker still starting
    (loading, warming up) is never lost; and only on the dispatcher's word, an answer given
    ``grace_s`` after the pid was first seen out: a dispatcher that does not answer kills nobody."""

    def __init__(self, client, grace_s: float, wake):
        self.grace_s = grace_s
        self._client = client
        self._wake = wake
        self._lock = threading.Lock()
        self._pids: set[int] = set()  # the worker children to watch
        self._restarting = False  # a worker is to be started again: its registration is awaited
        self._seen: set[int] = set()  # of those, seen registered
        self._out_since: dict[int, float] = {}  # seen registered, then out of rotation since
        self._answered_at = -math.inf  # the latest answer
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="up-lost-workers", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def watch(self, pids: set[int], restarting: bool = False) -> None:
        """The worker children now (a pid restarted away is forgotten); ``restarting``: one is
        waiting to be started again (the next poll must not be one for departures only, which
        would miss its registration: a pid never seen registered is never lost)."""
        with self._lock:
            self._pids = set(pids)
            self._restarting = restarting
            self._seen &= self._pids
            for pid in set(self._out_since) - self._pids:
                del self._out_since[pid]

    def update(self, registered: set[int], now: float) -> None:
        """One answer of the dispatcher: ``registered``, the pids of its workers, at ``now``."""
        with self._lock:
            self._answered_at = now
            for pid in self._pids & registered:
                self._seen.add(pid)
                self._out_since.pop(pid, None)
            for pid in self._seen - registered:
                self._out_since.setdefault(pid, now)

    def seen(self, pid: int) -> bool:
        """Whether ``pid`` was seen registered."""
        with self._lock:
            return pid in self._seen

    def lost(self) -> dict[int, float]:
        """pid -> seconds out of rotation, of the workers out at least ``grace_s`` by the latest answer."""
        with self._lock:
            out = {pid: self._answered_at - t for pid, t in self._out_since.items()}
        return {pid: s for pid, s in out.items() if s >= self.grace_s}

    def _run(self) -> None:
        registrations = departures = 0
        retry_s = READY_RETRY_S
        while not self._closed.is_set():
            with self._lock:
                unsettled = self._restarting or bool(self._pids - self._seen) or bool(self._out_since)
            try:
                if unsettled:  # a worker starting, or out: its registration is the news
                    st = self._client.status(min_registrations=registrations + 1, wait=self.grace_s / 2,
                                             timeout=READY_REPLY_S, brief=True)
                else:
                    st = self._client.status(min_departures=departures + 1, wait=LOST_POLL_S,
                                             timeout=READY_REPLY_S, brief=True)
            except Exception as e:  # noqa: BLE001 -- a failed poll is retried; close() ends the thread
                if self._closed.is_set():
                    return
                log.debug("lost-worker poll failed: %s: %s", type(e).__name__, e)
                self._closed.wait(retry_s)
                retry_s = min(READY_POLL_S, 2 * retry_s)
                continue
            retry_s = READY_RETRY_S
            registrations, departures = st.registrations, st.departures
            self.update({w.pid for w in st.workers}, time.monotonic())
            if self.lost():
                self._wake()

    def close(self) -> None:
        """Bounded: closing the client fails the poll in flight at once."""
        self._closed.set()
        self._client.close()
        if self._thread.ident is not None:
            self._thread.join(READY_REPLY_S)


def restart_delay(restarts: int, ran_s: float) -> tuple[float, int]:
    """(seconds to wait before starting a child again, its count of restarts in a row then), for
    a child that died after ``ran_s`` seconds, ``restarts`` restarts in a row so far."""
    if ran_s >= RESTART_STABLE_S:
        return 0.0, 0
    return min(RESTART_BACKOFF_MAX_S, 0.5 * 2 ** restarts), restarts + 1


class Supervisor:
    def __init__(self, config_path: str | Path, node: NodeConfig, log_level: str = "INFO",
                 child_watchdog: bool = False):
        self.config_path = str(config_path)
        self.node = node
        self.log_level = log_level
        self.dispatcher: Optional[subprocess.Popen] = None
        self.workers: dict[str, subprocess.Popen] = {}
        self.restarts: dict[str, int] = {}
        self._last_start: dict[str, float] = {}
        # A child started again after the node was ready -> by when it must have registered (a
        # worker) or said READY=1 (a front door); past it, it is hung starting, and killed.
        self._starting: dict[int, float] = {}
        self.start_timeout_s = READY_TIMEOUT_S
        self._notifications: Optional[ChildNotifications] = None
        # Only where run_forever reads the pings (run_up): running_node's children pinged nobody.
        self.child_watchdog_s = child_watchdog_s() if child_watchdog else None
        self._aborted: dict[int, float] = {}  # pid -> when a hung child was sent SIGABRT
        self._killed: dict[int, float] = {}  # pid -> when it was sent SIGKILL after that
        self._ended: set[int] = set()  # pids `up` killed for hanging (their exit is no news)
        self._lost: Optional[LostWorkers] = None
        self._spawned: set[int] = set()  # every child's pid, for their shared memory at the end
        # This run of the node, named to its front doors: one restarted within it keeps the
        # clients' shared-memory regions and the statistics (kserve_shm.ShmRegions).
        self.instance = f"{os.getpid()}-{time.time_ns()}"

    def _spawn(self, *args: str, python: str = "", env: Optional[dict] = None) -> subprocess.Popen:
        cmd = [python or sys.executable, "-m", "batchyard.cli", "--log-level", self.log_level, *args,
               "--config", self.config_path]
        # A session of its own: a terminal's Ctrl-C or hang-up (the foreground process group's
        # signal) reaches `up` alone, which stops its children in order; sent to all at once,
        # queued requests failed and a SIGHUP cut the batch in flight. (`up`'s death still ends
        # them: _die_with_parent.)
        proc = subprocess.Popen(cmd, preexec_fn=_die_with_parent, env=child_env() | (env or {}),
                                start_new_session=True)
        self._spawned.add(proc.pid)
        return proc

    def _watchdog_env(self) -> dict:
        """NOTIFY_SOCKET and WATCHDOG_USEC of `up`'s own, for the children with an event loop
        that pings it (the dispatcher, the front doors)."""
        env = {"NOTIFY_SOCKET": self._notifications.address}
        if self.child_watchdog_s is not None:
            env["WATCHDOG_USEC"] = str(int(self.child_watchdog_s * 1e6))
        return env

    def _front_door_pids(self) -> set[int]:
        return {p.pid for n, p in self.workers.items() if n.startswith(FRONTEND_NAME)}

    def start(self) -> None:
        self._notifications = ChildNotifications()
        self._notifications.read_in_background()
        self.dispatcher = self._spawn("dispatcher", env=self._watchdog_env())
        for w in self.node.workers:
            self.start_worker(w.name)
        # Front-door processes are supervised like workers, under names no worker can have.
        for i in range(self.node.frontend.processes if self.node.frontend else 0):
            self.start_worker(f"{FRONTEND_NAME}{i}")

    def start_worker(self, name: str) -> None:
        front_door = name.startswith(FRONTEND_NAME)
        args = ("frontend",) if front_door else ("worker", "--name", name)
        env = None
        if front_door:
            from .kserve_shm import NODE_INSTANCE_ENV

            env = {NODE_INSTANCE_ENV: self.instance} | (self._watchdog_env() if self._notifications is not None else {})
        self.workers[name] = self._spawn(*args, python=self._python(name), env=env)
        self._last_start[name] = time.monotonic()
        log.info("started %s %s (pid %d)", "front door" if front_door else "worker", name, self.workers[name].pid)

    def _python(self, name: str) -> str:
        """A vLLM worker runs under the interpreter that has vLLM (its own virtualenv: vLLM's CPU
        build pins libraries the rest of the node does not want)."""
        w = next((w for w in self.node.workers if w.name == name), None)
        return w.vllm.python if w is not None and w.kind == "vllm" and w.vllm.python else ""

    def wait_ready(self, timeout: float = READY_TIMEOUT_S, client=None) -> "object":
        """Block until every configured worker has registered with the dispatcher and every
        front-door process serves its ports; fail at once (not after ``timeout``) when the
        dispatcher or a worker exits during start-up (a front door: within READY_POLL_S).

        A poll that fails (DeadlineExceeded from a dispatcher too starved to answer in time,
        Unavailable from one still starting, anything else) is retried until ``timeout``;
        only then NodeNotReady, naming the last failure. ``client``: for tests."""
        n = len(self.node.workers)
        deadline = time.monotonic() + timeout
        # SIGCHLD blocked from here (the client's I/O thread inherits the mask): a child's death
        # stays pending for sigtimedwait below instead of being discarded on another thread.
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        try:
            with contextlib.ExitStack() as stack:
                c = client if client is not None else stack.enter_context(start_without_signals(self._client))
                retry_s, last, answered = READY_RETRY_S, "no reply from the dispatcher", False
                wanted = n  # registrations to wait for: every worker's, then the next one's
                while True:
                    self._check_started()
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise NodeNotReady(f"not ready within {timeout:.0f} s: {last}")
                    poll_s = min(READY_POLL_S, left)
                    # Until the dispatcher first answers, a short wait for the reply: one that
                    # died starting was noticed only after READY_REPLY_S (5 s) more.
                    reply_s = READY_REPLY_S if answered else READY_POLL_S
                    try:
                        st = c.status(min_registrations=wanted, wait=poll_s,
                                      timeout=min(reply_s, max(0.5, left - poll_s)))
                        answered = True
                        if self.dispatcher is not None and st.dispatcher_pid != self.dispatcher.pid:
                            # Another node's dispatcher on this address (this one refuses to
                            # bind it and exits): its registrations are not this node's.
                            raise NodeNotReady(f"pid {st.dispatcher_pid}, not this node's dispatcher, "
                                               f"answers at {self.node.dispatcher.frontend}")
                    except NodeNotReady:
                        raise
                    except Exception as e:  # noqa: BLE001 -- every failure of a poll is retried
                        last = f"last readiness poll failed: {type(e).__name__}: {e}"
                        # A back-off, not a hot loop; a child's death (SIGCHLD) ends it at once.
                        signal.sigtimedwait({signal.SIGCHLD}, min(retry_s, max(0.0, deadline - time.monotonic())))
                        retry_s = min(READY_POLL_S, 2 * retry_s)
                        continue
                    missing = self._unregistered(st)
                    if not missing:
                        self._wait_front_doors(deadline, timeout)
                        return st
                    # The count of registrations counts a worker that dropped out and registered
                    # again twice: `up` said ready with another worker never registered.
                    wanted = max(n, st.registrations + 1)
                    last = f"{n - len(missing)} of {n} workers registered (not: {', '.join(sorted(missing))})"
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

    def _unregistered(self, st) -> set[str]:
        """The configured workers the dispatcher does not list as registered by the process `up`
        started under that name (a worker is listed by the pid it registered from)."""
        listed = {w.name: w.pid for w in st.workers}
        return {w.name for w in self.node.workers
                if w.name not in listed or (w.name in self.workers and listed[w.name] != self.workers[w.name].pid)}

    def _wait_front_doors(self, deadline: float, timeout: float) -> None:
        ready = self._notifications
        if ready is None or not self._front_door_pids():
            return
        while True:
            pids = self._front_door_pids()
            serving = ready.ready_among(pids)
            if serving == pids:
                return
            self._check_started()
            left = deadline - time.monotonic()
            if left <= 0:
                raise NodeNotReady(f"not ready within {timeout:.0f} s: {len(serving)} of "
                                   f"{len(pids)} front-door processes serving")
            ready.wait(min(READY_POLL_S, left))  # READY_POLL_S: as late as a front door's death is seen

    def _check_started(self) -> None:
        if self.dispatcher is not None and self.dispatcher.poll() is not None:
            code = self.dispatcher.returncode
            raise NodeNotReady(f"the dispatcher exited with {code} during start-up",
                               EX_CONFIG if code == EX_CONFIG else 1)
        for name, proc in self.workers.items():
            if proc.poll() is not None:
                config = proc.returncode == EX_CONFIG
                why = "cannot run on this host as configured" if config else f"exited with {proc.returncode}"
                raise NodeNotReady(f"worker {name} {why} during start-up (see its log above)",
                                   EX_CONFIG if config else 1)

    def run_forever(self) -> int:
        """Supervise until SIGTERM/SIGINT/SIGHUP. Returns the exit code for the `up` command."""
        sigs = STOP_SIGNALS | {signal.SIGCHLD, signal.SIGIO}
        # SIGIO: a child's datagram (ChildNotifications.raise_sigio). Its default action ends the
        # process; a no-op handler where it lands on a thread that does not block it.
        signal.signal(signal.SIGIO, lambda *_: None)
        signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
        self._notifications.stop_reading()  # from here the loop below reads, woken by SIGIO
        self._notifications.raise_sigio(True)
        pending_restart: dict[str, float] = {}
        # systemd's watchdog (WatchdogSec=): pinged from this loop, so a wedged `up` is restarted.
        watchdog_s = watchdog_interval_s()
        next_ping = time.monotonic()
        # Started with the signals blocked: its threads (and its client's) leave them to this one.
        main = threading.get_ident()
        self._lost = LostWorkers(self._client(), max(self.node.dispatcher.worker_dead_after_s, LOST_WORKER_GRACE_MIN_S),
                                 lambda: signal.pthread_kill(main, signal.SIGCHLD))
        self._lost.watch(self._worker_pids())  # before its first poll: every worker is awaited
        self._lost.start()
        try:
            while True:
                self._notifications.receive()  # pings; restarted front doors' READY=1: nothing waits for it
                # Look at the children *before* waiting: a child that died before the mask
                # above was set sent a SIGCHLD that is gone, but it is still a zombie to poll().
                if self.dispatcher.poll() is not None:
                    log.error("dispatcher exited with %s; stopping the node", self.dispatcher.returncode)
                    return 1
                now = time.monotonic()
                wake_at = self._end_hung(now)
                for name, proc in list(self.workers.items()):
                    if proc.poll() is None or name in pending_restart:
                        continue
                    self._notifications.forget(proc.pid)
                    self._aborted.pop(proc.pid, None)
                    self._killed.pop(proc.pid, None)
                    self._starting.pop(proc.pid, None)
                    kind = "front door" if name.startswith(FRONTEND_NAME) else "worker"
                    if proc.returncode == EX_CONFIG and kind == "front door":
                        # Given up, its ports stayed dead while `up` went on pinging the
                        # watchdog: a unit systemd saw healthy served no KServe client.
                        log.error("front door %s cannot run on this host as configured (exit %d, see its "
                                  "log); stopping the node", name, EX_CONFIG)
                        return EX_CONFIG
                    # A worker's EX_CONFIG after the node was ready comes of the same config that
                    # started it (up's snapshot): of the host, or of its model's factory failing for
                    # a while, which a restart may get past. Given up for good, a worker whose
                    # factory raised once was gone while systemd saw a healthy node (an outside
                    # review); restarted with the back-off, it comes back once the cause goes.
                    delay, self.restarts[name] = restart_delay(self.restarts.get(name, 0),
                                                               now - self._last_start.get(name, 0.0))
                    why = (" (killed by up: hung)" if proc.pid in self._ended else
                           " (the dispatcher declared it hung)" if proc.returncode == EX_SOFTWARE else
                           " (it cannot start as configured: see its log)" if proc.returncode == EX_CONFIG else "")
                    self._ended.discard(proc.pid)
                    log.warning("%s %s (pid %d) exited with %s%s; restart in %.1f s",
                                kind, name, proc.pid, proc.returncode, why, delay)
                    pending_restart[name] = now + delay
                for name, at in list(pending_restart.items()):
                    if at <= now:
                        del pending_restart[name]
                        self.start_worker(name)
                        self._starting[self.workers[name].pid] = now + self.start_timeout_s
                self._lost.watch(self._worker_pids(pending_restart), restarting=bool(pending_restart))
                wake_at += list(pending_restart.values())
                if watchdog_s is not None:
                    # Pinged while every child is alive or being ended by this loop; a child
                    # that outlives its SIGKILL (stuck in the kernel) is systemd's to handle.
                    if now >= next_ping:
                        if not self._unkillable(now):
                            notify("WATCHDOG=1")
                        next_ping = now + watchdog_s
                    wake_at.append(next_ping)
                if min(wake_at) < math.inf:
                    info = signal.sigtimedwait(sigs, max(0.0, min(wake_at) - time.monotonic()))
                else:
                    info = signal.sigwaitinfo(sigs)
                if info is not None and info.si_signo in STOP_SIGNALS:
                    log.info("signal %d: stopping", info.si_signo)
                    return 0
        finally:
            self._notifications.raise_sigio(False)
            self._lost.close()
            signal.pthread_sigmask(signal.SIG_UNBLOCK, sigs)

    def _worker_pids(self, leaving=()) -> set[int]:
        return {p.pid for n, p in self.workers.items() if not n.startswith(FRONTEND_NAME) and n not in leaving}

    def _client(self):
        from .client import Client

        return Client(self.node.dispatcher.frontend,
                      **node_client_keys(self.node.dispatcher, self.node.dispatcher.frontend))

    def _end_hung(self, now: float) -> list[float]:
        """Abort the dispatcher or a front door silent for the watchdog period (SIGKILL once
        CHILD_ABORT_GRACE_S has passed), and kill a worker the dispatcher has kept out of
        rotation past its grace; their deaths then come as any other (SIGCHLD). Returns when
        to look again."""
        wake_at = [math.inf]
        watched = [("dispatcher", self.dispatcher), *((n, p) for n, p in self.workers.items()
                                                      if n.startswith(FRONTEND_NAME))]
        for name, proc in watched:
            alive_at = self._notifications.alive_at.get(proc.pid)
            if alive_at is None or proc.poll() is not None or self.child_watchdog_s is None:
                continue
            silent = now - alive_at
            aborted = self._aborted.get(proc.pid)
            if silent < self.child_watchdog_s:
                self._aborted.pop(proc.pid, None)  # it pinged after all
                wake_at.append(alive_at + self.child_watchdog_s)
            elif aborted is None:
                log.error("%s (pid %d) sent no WATCHDOG=1 for %.1f s: hung; aborting it (SIGABRT)",
                          name, proc.pid, silent)
                proc.send_signal(signal.SIGABRT)
                self._aborted[proc.pid] = now
                self._ended.add(proc.pid)
                wake_at.append(now + CHILD_ABORT_GRACE_S)
            elif now - aborted >= CHILD_ABORT_GRACE_S:
                if proc.pid not in self._killed:
                    log.error("%s (pid %d) still there %.0f s after SIGABRT; killing it", name, proc.pid, now - aborted)
                    proc.kill()
                    self._killed[proc.pid] = now
                if now < self._killed[proc.pid] + 1.0:  # then _unkillable; its death wakes sooner
                    wake_at.append(self._killed[proc.pid] + 1.0)
            else:
                wake_at.append(aborted + CHILD_ABORT_GRACE_S)
        for pid, due in list(self._starting.items()):
            name = next((n for n, p in self.workers.items() if p.pid == pid and p.poll() is None), None)
            front_door = name is not None and name.startswith(FRONTEND_NAME)
            if name is None or (self._notifications.ready_among({pid}) if front_door else self._lost.seen(pid)):
                del self._starting[pid]  # up and serving (or gone: its death is news of its own)
            elif now >= due:
                # A restart hanging in its start (a model factory that never returns) was never
                # noticed: no registration, so never lost, and its model's requests waited out
                # their deadlines (an outside review). The node's first start has wait_ready's.
                log.error("%s %s (pid %d) not %s %.0f s after its start: hung starting; killing it",
                          "front door" if front_door else "worker", name, pid,
                          "serving" if front_door else "registered", now - self._last_start[name])
                del self._starting[pid]
                self._ended.add(pid)
                self.workers[name].kill()
            else:
                wake_at.append(due)
        for pid, out_s in self._lost.lost().items():
            name = next((n for n, p in self.workers.items() if p.pid == pid and p.poll() is None), None)
            if name is not None and pid not in self._ended:
                log.error("worker %s (pid %d) out of rotation for %.1f s and not registered again "
                          "(no heartbeat, or a batch that never came back): hung; killing it", name, pid, out_s)
                self._ended.add(pid)
                self.workers[name].kill()
        return wake_at

    def _unkillable(self, now: float) -> bool:
        """A hung child still there a second after its SIGKILL (stuck in the kernel)."""
        return any(now - at >= 1.0 for at in self._killed.values())

    def stop(self) -> None:
        """Front doors first (their requests in flight finish while the dispatcher and the
        workers still serve them), then the dispatcher (it drains: the requests it already
        took, queued or running, are served by the workers, still up, for up to
        drain_timeout_s), then the workers (they finish their batch; the dispatcher told each
        that it was closing, so none waits for an answer to its `leaving`, workers/runtime.py);
        each group bounded. Stopped before the drain, the workers left the queue to nobody: 22
        of 30 requests queued behind a 1 s batch failed UNAVAILABLE. Then the shared memory of
        children that were killed, which no process of this node would reap any more.

        Nothing watches the children by now (run_forever has returned, the lost-worker poll is
        closed here): the dispatcher's exit is the stop's, not a failure to act on."""
        if self._lost is not None:
            self._lost.close()
        front = [p for n, p in self.workers.items() if n.startswith(FRONTEND_NAME)]
        workers = [p for n, p in self.workers.items() if not n.startswith(FRONTEND_NAME)]
        _stop_all(front, STOP_TIMEOUT_S)
        if self.dispatcher is not None:
            # A drain longer than STOP_TIMEOUT_S was cut by SIGKILL.
            _stop_all([self.dispatcher], max(STOP_TIMEOUT_S, self.node.dispatcher.drain_timeout_s + DRAIN_MARGIN_S))
            if self.dispatcher.returncode < 0:  # killed (here, hung, or by anyone): it removed no file
                _remove_stale_ipc((self.node.dispatcher.frontend, self.node.dispatcher.backend))
        _stop_all(workers, STOP_TIMEOUT_S)
        if self._notifications is not None:
            self._notifications.close()
            self._notifications = None
        self._reap_killed()

    def _reap_killed(self) -> None:
        """What children killed hard (SIGKILL) left, which no process of the node would reap
        after its stop: their shared-memory segments nobody holds (a front door's 64 MiB pool;
        only those named after this node's children), and the front doors' registry folder
        when none of them is left (the last one out removes it; killed, none did)."""
        from .shm import reap_orphans

        reaped = reap_orphans(grace_s=0.0, pids=self._spawned)
        if reaped:
            log.info("removed %d shared-memory segments of the node's processes killed hard", len(reaped))
        fe = self.node.frontend
        if fe is not None and fe.processes:
            from .kserve_shm import ShmRegions, registry_dir

            path = registry_dir(fe.host, fe.grpc_port, fe.http_port)
            if os.path.isdir(path):
                with contextlib.suppress(OSError):
                    ShmRegions(path).close()  # joins and leaves: the last one out removes it


@contextlib.contextmanager
def running_node(node: NodeConfig, log_level: str = "WARNING", ready_timeout_s: float = 300.0):
    """Write ``node`` to a private config, start its processes, wait until every worker has
    registered, yield the Supervisor, and always stop everything (demo, benches, tests)."""
    with tempfile.TemporaryDirectory(prefix="by-node-") as d:
        cfg = Path(d) / "node.toml"
        cfg.write_text(to_toml(node))
        sup = Supervisor(cfg, node, log_level=log_level)
        sup.start()
        try:
            sup.wait_ready(ready_timeout_s)
            yield sup
        finally:
            sup.stop()


def _stop_all(procs: list[subprocess.Popen], timeout: float) -> None:
    """SIGTERM ``procs``, wait up to ``timeout`` for all, SIGKILL those left."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("pid %d did not stop within %.0f s; killing it", p.pid, timeout)
            p.kill()
            p.wait()


def _remove_stale_ipc(endpoints) -> None:
    """The ipc socket files of a dispatcher that was killed (it removes them when it exits
    itself): left behind, the next dispatcher's check took them for another's. Only files no
    process listens on any more: connect() is refused."""
    for endpoint in endpoints:
        if not endpoint.startswith("ipc://"):
            continue
        path = endpoint[len("ipc://"):]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as s:
            try:
                s.connect(path)
                continue  # someone serves it
            except ConnectionRefusedError:
                pass
            except OSError:
                continue  # gone already, or not ours to judge
        with contextlib.suppress(OSError):
            os.unlink(path)


def run_up(config_path: str, node: NodeConfig, log_level: str = "INFO",
           ready_timeout_s: float = READY_TIMEOUT_S) -> int:
    from .proctitle import set_title

    set_title("batchyard::up")

    def stop_now(signo, _frame):
        # Said as run_forever says it: a signal just after "ready", before run_forever took the
        # signals over, stopped the node without a word of why.
        log.info("signal %d: stopping", signo)
        raise SystemExit(0)  # unwinds out of start-up (e.g. wait_ready) into sup.stop() below

    # SIGTERM may come at any moment, also before run_forever takes the signals over.
    for sig in STOP_SIGNALS:
        signal.signal(sig, stop_now)
    # Every child, restarts included, runs the config validated here, from a private copy: read
    # again from its file, an edit made on disk while the node ran reached the next child that
    # restarted (a typo gave up a crashed worker and front door for good, a changed port moved
    # the front door's).
    snapshot_dir = PrivateDir("by-up-")  # an `up` killed outright leaves it to the next one's start
    snapshot = snapshot_dir.path / Path(config_path).name
    snapshot.write_text(SNAPSHOT_HEADER.format(path=os.path.abspath(config_path), pid=os.getpid()) + to_toml(node))
    sup = Supervisor(snapshot, node, log_level, child_watchdog=True)
    try:
        sup.start()
        try:
            st = sup.wait_ready(ready_timeout_s)
        except Exception as e:  # noqa: BLE001 -- one clear line and exit 1 (78), never a traceback
            why = str(e) if isinstance(e, NodeNotReady) else f"{type(e).__name__}: {e}"
            log.error("node did not start: %s", why)
            return e.exit_code if isinstance(e, NodeNotReady) else 1
        log.info("node ready: %d workers, models %s", len(st.workers), st.models)
        try:
            print(f"batchyard up: ready, clients connect to {node.dispatcher.frontend}", flush=True)
        except OSError as e:  # nobody reads stdout any more (`up | head`): not the node's failure
            log.warning("cannot write the ready line to stdout (%s); serving on", e)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (nor a second failure at exit)
        notify(f"READY=1\nSTATUS=ready: {len(st.workers)} workers, clients at {node.dispatcher.frontend}")
        return sup.run_forever()
    finally:
        notify("STOPPING=1")
        for sig in STOP_SIGNALS:  # a second signal must not cut the cleanup short
            signal.signal(sig, signal.SIG_IGN)
        sup.stop()
        snapshot_dir.cleanup()
