"""``batchyard up``: start a node's dispatcher and workers, wait until ready, restart workers
that die, and stop everything cleanly on SIGTERM/SIGINT.

Children are plain processes (``python -m batchyard.cli ...``) so that systemd units can run
exactly the same commands one by one. Each child gets PR_SET_PDEATHSIG so that nothing
outlives a supervisor that was killed hard. Waiting is on signals (sigtimedwait on SIGCHLD,
SIGTERM, SIGINT), never a polling loop: `up` learns that a child died from the kernel
(SIGCHLD, then waitpid), never from a missing heartbeat, so a starved machine cannot make it
restart a healthy worker.

Under systemd (``Type=notify``) `up` sends READY=1 once every worker has registered and
every front-door process serves its ports, and WATCHDOG=1 from its wait loop; its children do
not inherit systemd's notification socket. The front-door processes get one of `up`'s own
instead: each sends READY=1 there once its ports are bound (as it would to systemd), which is
how `up` knows that a client may connect — not a port probe.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import secrets
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from .exit_codes import EX_CONFIG, EX_SOFTWARE
from .config import NodeConfig, to_toml
from .sd_notify import child_env, notify, watchdog_interval_s
from .transport import node_client_keys

log = logging.getLogger("batchyard.up")
FRONTEND_NAME = "frontend#"  # '#' is not allowed in worker names
_PR_SET_PDEATHSIG = 1
RESTART_BACKOFF_MAX_S = 10.0
STOP_TIMEOUT_S = 10.0
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
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT})


class FrontDoorsReady:
    """The READY=1 datagrams of the front-door processes, on a socket of `up`'s own that they
    get as NOTIFY_SOCKET (sd_notify's protocol, so the same front door under systemd tells
    systemd). The kernel stamps each datagram with its sender's pid (SO_PASSCRED), and only
    the pids of this `up`'s front-door children count: the socket's abstract name is visible
    to every process of the network namespace."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        name = f"batchyard-up-{os.getpid()}-{secrets.token_hex(6)}"
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind("\0" + name)
        self.address = "@" + name  # NOTIFY_SOCKET's spelling of an abstract name
        self.ready_pids: set[int] = set()

    def receive(self) -> None:
        """Take every datagram waiting (never blocks); remember the senders that said READY=1."""
        creds = struct.calcsize("3i")
        while True:
            try:
                data, anc, _flags, _addr = self.sock.recvmsg(4096, socket.CMSG_SPACE(creds))
            except (BlockingIOError, InterruptedError):
                return
            pid = next((struct.unpack("3i", d[:creds])[0] for level, kind, d in anc
                        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS), None)
            if pid is not None and b"READY=1" in data.split(b"\n"):
                self.ready_pids.add(pid)

    def wait(self, seconds: float) -> None:
        """Block until a datagram arrives or ``seconds`` pass, then take what came."""
        select.select([self.sock], [], [], seconds)
        self.receive()

    def close(self) -> None:
        self.sock.close()


class Supervisor:
    def __init__(self, config_path: str | Path, node: NodeConfig, log_level: str = "INFO"):
        self.config_path = str(config_path)
        self.node = node
        self.log_level = log_level
        self.dispatcher: Optional[subprocess.Popen] = None
        self.workers: dict[str, subprocess.Popen] = {}
        self.restarts: dict[str, int] = {}
        self.given_up: set[str] = set()
        self._last_start: dict[str, float] = {}
        self._front_doors_ready: Optional[FrontDoorsReady] = None

    def _spawn(self, *args: str, python: str = "", env: Optional[dict] = None) -> subprocess.Popen:
        cmd = [python or sys.executable, "-m", "batchyard.cli", "--log-level", self.log_level, *args,
               "--config", self.config_path]
        return subprocess.Popen(cmd, preexec_fn=_die_with_parent, env=child_env() | (env or {}))

    def _front_door_pids(self) -> set[int]:
        return {p.pid for n, p in self.workers.items() if n.startswith(FRONTEND_NAME)}

    def start(self) -> None:
        if self.node.frontend is not None and self.node.frontend.processes:
            self._front_doors_ready = FrontDoorsReady()
        self.dispatcher = self._spawn("dispatcher")
        for w in self.node.workers:
            self.start_worker(w.name)
        # Front-door processes are supervised like workers, under names no worker can have.
        for i in range(self.node.frontend.processes if self.node.frontend else 0):
            self.start_worker(f"{FRONTEND_NAME}{i}")

    def start_worker(self, name: str) -> None:
        front_door = name.startswith(FRONTEND_NAME)
        args = ("frontend",) if front_door else ("worker", "--name", name)
        env = {"NOTIFY_SOCKET": self._front_doors_ready.address} if front_door and self._front_doors_ready else None
        self.workers[name] = self._spawn(*args, python=self._python(name), env=env)
        self._last_start[name] = time.monotonic()
        log.info("started worker %s (pid %d)", name, self.workers[name].pid)

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
        from .client import Client

        n = len(self.node.workers)
        deadline = time.monotonic() + timeout
        # SIGCHLD blocked from here (the client's I/O thread inherits the mask): a child's death
        # stays pending for sigtimedwait below instead of being discarded on another thread.
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        try:
            with contextlib.ExitStack() as stack:
                c = client if client is not None else stack.enter_context(Client(
                    self.node.dispatcher.frontend, **node_client_keys(self.node.dispatcher, self.node.dispatcher.frontend)))
                retry_s, last, answered = READY_RETRY_S, "no reply from the dispatcher", False
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
                        st = c.status(min_registrations=n, wait=poll_s,
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
                    if st.registrations >= n:
                        self._wait_front_doors(deadline, timeout)
                        return st
                    last = f"only {st.registrations} of {n} workers registered"
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

    def _wait_front_doors(self, deadline: float, timeout: float) -> None:
        ready = self._front_doors_ready
        if ready is None:
            return
        while True:
            ready.receive()
            pids = self._front_door_pids()
            if pids <= ready.ready_pids:
                return
            self._check_started()
            left = deadline - time.monotonic()
            if left <= 0:
                raise NodeNotReady(f"not ready within {timeout:.0f} s: {len(pids & ready.ready_pids)} of "
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
        """Supervise until SIGTERM/SIGINT. Returns the exit code for the `up` command."""
        sigs = {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT}
        signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
        pending_restart: dict[str, float] = {}
        # systemd's watchdog (WatchdogSec=): pinged from this loop, so a wedged `up` is restarted.
        watchdog_s = watchdog_interval_s()
        next_ping = time.monotonic()
        try:
            while True:
                if self._front_doors_ready is not None:
                    self._front_doors_ready.receive()  # restarted front doors' READY=1: nothing waits for it
                # Look at the children *before* waiting: a child that died before the mask
                # above was set sent a SIGCHLD that is gone, but it is still a zombie to poll().
                if self.dispatcher.poll() is not None:
                    log.error("dispatcher exited with %s; stopping the node", self.dispatcher.returncode)
                    return 1
                now = time.monotonic()
                for name, proc in list(self.workers.items()):
                    if proc.poll() is None or name in pending_restart or name in self.given_up:
                        continue
                    if proc.returncode == EX_CONFIG:
                        log.error("worker %s cannot run on this host as configured (exit %d, see its log); "
                                  "not restarting it", name, EX_CONFIG)
                        self.given_up.add(name)
                        continue
                    # Back off only when a worker keeps dying right after start.
                    quick = now - self._last_start.get(name, 0.0) < 5.0
                    n = self.restarts.get(name, 0)
                    delay = min(RESTART_BACKOFF_MAX_S, 0.5 * 2 ** n) if quick else 0.0
                    self.restarts[name] = n + 1 if quick else 0
                    why = " (the dispatcher declared it hung)" if proc.returncode == EX_SOFTWARE else ""
                    log.warning("worker %s (pid %d) exited with %s%s; restart in %.1f s",
                                name, proc.pid, proc.returncode, why, delay)
                    pending_restart[name] = now + delay
                for name, at in list(pending_restart.items()):
                    if at <= now:
                        del pending_restart[name]
                        self.start_worker(name)
                wake_at = list(pending_restart.values())
                if watchdog_s is not None:
                    if now >= next_ping:
                        notify("WATCHDOG=1")
                        next_ping = now + watchdog_s
                    wake_at.append(next_ping)
                if wake_at:
                    info = signal.sigtimedwait(sigs, max(0.0, min(wake_at) - time.monotonic()))
                else:
                    info = signal.sigwaitinfo(sigs)
                if info is not None and info.si_signo in (signal.SIGTERM, signal.SIGINT):
                    log.info("signal %d: stopping", info.si_signo)
                    return 0
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, sigs)

    def stop(self) -> None:
        """Workers first (they finish their batch), then the dispatcher (it drains)."""
        procs = list(self.workers.values())
        for p in procs:
            if p.poll() is None:
                p.terminate()
        _wait_all(procs, STOP_TIMEOUT_S)
        if self.dispatcher is not None:
            if self.dispatcher.poll() is None:
                self.dispatcher.terminate()
            _wait_all([self.dispatcher], STOP_TIMEOUT_S)
        if self._front_doors_ready is not None:
            self._front_doors_ready.close()
            self._front_doors_ready = None


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


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("pid %d did not stop within %.0f s; killing it", p.pid, timeout)
            p.kill()
            p.wait()


def run_up(config_path: str, node: NodeConfig, log_level: str = "INFO",
           ready_timeout_s: float = READY_TIMEOUT_S) -> int:
    from .proctitle import set_title

    set_title("batchyard::up")

    def stop_now(_signo, _frame):
        raise SystemExit(0)  # unwinds out of start-up (e.g. wait_ready) into sup.stop() below

    # SIGTERM may come at any moment, also before run_forever takes the signals over.
    signal.signal(signal.SIGTERM, stop_now)
    signal.signal(signal.SIGINT, stop_now)
    sup = Supervisor(config_path, node, log_level)
    try:
        sup.start()
        try:
            st = sup.wait_ready(ready_timeout_s)
        except Exception as e:  # noqa: BLE001 -- one clear line and exit 1 (78), never a traceback
            why = str(e) if isinstance(e, NodeNotReady) else f"{type(e).__name__}: {e}"
            log.error("node did not start: %s", why)
            return e.exit_code if isinstance(e, NodeNotReady) else 1
        log.info("node ready: %d workers, models %s", len(st.workers), st.models)
        print(f"batchyard up: ready, clients connect to {node.dispatcher.frontend}", flush=True)
        notify(f"READY=1\nSTATUS=ready: {len(st.workers)} workers, clients at {node.dispatcher.frontend}")
        return sup.run_forever()
    finally:
        notify("STOPPING=1")
        for sig in (signal.SIGTERM, signal.SIGINT):  # a second signal must not cut the cleanup short
            signal.signal(sig, signal.SIG_IGN)
        sup.stop()
