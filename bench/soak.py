"""A soak of a live node under faults (issue 11, "What it must show"):
``python -m batchyard.bench.soak --minutes 3``.

The soak is its own supervisor: it starts the dispatcher and simulated workers as separate
processes (not `batchyard up`, which stops the node when its dispatcher dies) on ipc endpoints
in a temp dir, restarts any worker that dies and waits for it to re-register. For the whole
run, SDK client processes send valid requests (small ones inline, 1 MiB ones through shared
memory; random priorities and timeouts) and fuzzer processes send malformed headers and
references to shared memory they do not own from raw DEALER sockets (bench/soak_traffic.py).
Faults: a worker SIGKILLed every 10-20 s, one client process SIGKILLed (its segments must be
reaped by the dispatcher's janitor), one SIGKILL of the dispatcher followed by a restart on the
same address (SDK clients must see UNAVAILABLE for requests in flight, then reconnect).

At the end: every request answered exactly once or failed explicitly, per client; dispatcher
RSS and fds at start, before its kill and at the end; Batchyard segments left in /dev/shm;
processes left behind. A summary is printed and written to bench/results/soak.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import platform
import random
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from batchyard.client import Client
from batchyard.config import (DispatcherConfig, ModelConfig, NodeConfig, SimConfig, TensorConfig, WorkerConfig,
                              to_toml)
from batchyard.errors import BatchyardError
from batchyard.shm import live_segments

from .soak_traffic import BIG_SHAPE, SUM_SHAPE, fuzzer, sdk_client

RESULTS = Path(__file__).resolve().parent / "results" / "soak.json"
REGISTER_TIMEOUT_S = 60.0
OUTAGE_S = 1.0  # how long the dispatcher stays dead before its replacement starts
REAP_WAIT_S = 15.0  # bound on waiting for the janitor (interval 1 s) to reap a killed client's segments
WARMUP_S = 8.0


def node_config(run_dir: str, n_workers: int) -> NodeConfig:
    models = (ModelConfig(name="sum", max_batch=16, inputs=(TensorConfig("x", "float32", SUM_SHAPE),),
                          outputs=(TensorConfig("y", "float32", (2,)),)),
              ModelConfig(name="big", max_batch=4, inputs=(TensorConfig("x", "float32", BIG_SHAPE),),
                          outputs=(TensorConfig("y", "float32", BIG_SHAPE),)))
    workers = tuple(WorkerConfig(name=f"sim{i}", kind="sim", models=("sum", "big"),
                                 sim=SimConfig(launch_us=200.0, per_item_us=20.0)) for i in range(n_workers))
    d = DispatcherConfig(frontend=f"ipc://{run_dir}/fe", backend=f"ipc://{run_dir}/be", janitor_interval_s=1.0)
    return NodeConfig(dispatcher=d, models=models, workers=workers).validate()


def _die_with_parent() -> None:
    """In the child between fork and exec: if the soak dies, its node goes with it."""
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def resources(pid: int) -> dict:
    p = psutil.Process(pid)
    return {"pid": pid, "rss_mib": round(p.memory_info().rss / 2**20, 1), "fds": p.num_fds()}


class SoakNode:
    """Dispatcher and worker processes the soak starts, watches (pidfds) and restarts."""

    def __init__(self, run_dir: str, node: NodeConfig):
        self.run_dir = run_dir
        self.node = node
        self.config = Path(run_dir) / "node.toml"
        self.config.write_text(to_toml(node))
        self.log = open(Path(run_dir) / "node.log", "ab")
        self.procs: dict[str, subprocess.Popen] = {}  # "dispatcher" or a worker's name
        self.pids_seen: set[int] = set()
        self.selector = selectors.DefaultSelector()
        self.expected_deaths: set[int] = set()  # pids the soak killed itself
        self.events: list[dict] = []  # deaths and restarts, with times
        self.t0 = time.monotonic()
        self.client = None  # the soak's own Client, for readiness long polls

    def at(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    def _spawn(self, key: str, *args: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-m", "batchyard.cli", "--log-level", "WARNING", *args,
                              "--config", str(self.config)], stdout=self.log, stderr=self.log,
                             preexec_fn=_die_with_parent)
        self.procs[key] = p
        self.pids_seen.add(p.pid)
        self.selector.register(os.pidfd_open(p.pid), selectors.EVENT_READ, key)
        return p

    def start(self) -> float:
        self._spawn("dispatcher", "dispatcher")
        for w in self.node.workers:
            self._spawn(w.name, "worker", "--name", w.name)
        self.client = Client(self.node.dispatcher.frontend)
        return self.wait_registered(len(self.node.workers))

    def wait_registered(self, n: int = 0, worker: str = "", pid: int = 0) -> float:
        """Seconds until ``n`` registrations happened, or until ``worker`` runs as ``pid``."""
        t0 = time.monotonic()
        end = t0 + REGISTER_TIMEOUT_S
        seen = 0
        while time.monotonic() < end:
            try:
                st = self.client.status(min_registrations=max(n, seen + 1 if worker else 0),
                                        wait=min(5.0, end - time.monotonic()), timeout=5.0)
            except BatchyardError:  # the dispatcher is restarting: ask again
                continue
            seen = st.registrations
            if (worker and any(w.name == worker and w.pid == pid for w in st.workers)) or \
                    (not worker and st.registrations >= n):
                return time.monotonic() - t0
        raise RuntimeError(f"node not ready within {REGISTER_TIMEOUT_S} s (worker {worker!r}, n {n})")

    def kill(self, key: str) -> int:
        pid = self.procs[key].pid
        self.expected_deaths.add(pid)
        os.kill(pid, signal.SIGKILL)
        return pid

    def supervise(self, until: float) -> None:
        """Restart whatever dies until ``until`` (monotonic); a worker's restart waits for its
        re-registration. The dispatcher is restarted only by ``restart_dispatcher``."""
        while (left := until - time.monotonic()) > 0:
            for key_obj, _ in self.selector.select(timeout=min(left, 0.5)):
                key = key_obj.data
                self.selector.unregister(key_obj.fileobj)
                os.close(key_obj.fileobj)
                p = self.procs[key]
                rc = p.wait()
                expected = p.pid in self.expected_deaths
                self.events.append({"t": self.at(), "event": "died", "process": key, "pid": p.pid, "rc": rc,
                                    "killed_by_soak": expected})
                if key == "dispatcher":
                    if not expected:  # a crash: restart it at once, and say so in the report
                        self.restart_dispatcher()
                    continue
                new = self._spawn(key, "worker", "--name", key)
                if self.procs["dispatcher"].poll() is not None:  # in the outage: it registers with the next one
                    self.events.append({"t": self.at(), "event": "restarted", "process": key, "pid": new.pid})
                    continue
                took = self.wait_registered(worker=key, pid=new.pid)
                self.events.append({"t": self.at(), "event": "re-registered", "process": key, "pid": new.pid,
                                    "after_s": round(took, 2)})

    def restart_dispatcher(self) -> float:
        self._spawn("dispatcher", "dispatcher")
        took = self.wait_registered(len(self.node.workers))
        self.events.append({"t": self.at(), "event": "dispatcher ready", "pid": self.procs["dispatcher"].pid,
                            "after_s": round(took, 2)})
        return took

    def stop(self) -> dict[str, int | None]:
        """SIGTERM everything (dispatcher last), then SIGKILL what is left; exit codes."""
        if self.client is not None:
            self.client.close()
        order = [k for k in self.procs if k != "dispatcher"] + ["dispatcher"]
        codes = {}
        for k in order:
            p = self.procs[k]
            if p.poll() is None:
                p.terminate()
            try:
                codes[k] = p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                codes[k] = p.wait()
        self.log.close()
        return codes


def leftover_processes(run_dir: str, ours: set[int]) -> list[str]:
    """Live processes the soak started (by pid) or that name its run dir (a node child)."""
    left = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if p.info["pid"] in ours or run_dir in cmd:
                left.append(f"{p.info['pid']} {cmd[:120]}")
        except psutil.Error:
            pass
    return left


def run(minutes: float, n_workers: int, n_sdk: int, n_fuzz: int, seed: int) -> dict:
    rng = random.Random(seed)
    duration = minutes * 60.0
    run_dir = tempfile.mkdtemp(prefix="by-soak-", dir="/tmp")
    node = SoakNode(run_dir, node_config(run_dir, n_workers))
    ctx = mp.get_context("spawn")
    stop, results = ctx.Event(), ctx.Queue()
    marks = ctx.Array("d", [0.0, 0.0])  # monotonic: dispatcher killed, replacement ready
    address = node.node.dispatcher.frontend
    clients: dict[str, mp.Process] = {}
    report: dict = {"minutes": minutes, "seed": seed, "workers": n_workers, "host": platform.node(),
                    "cpus": os.cpu_count(), "load_avg_start": os.getloadavg()}
    try:
        report["node_ready_s"] = round(node.start(), 2)
        for i in range(n_sdk + 1):  # the last one is the victim of the client SIGKILL
            name = f"sdk{i}" if i < n_sdk else "victim"
            clients[name] = ctx.Process(target=sdk_client, name=name, args=(
                name, address, seed * 100 + i, 40.0, 4, 0.35 if i < n_sdk else 0.6, stop, marks, results))
        for c in clients.values():
            c.start()
        victims = [c.pid for c in clients.values()]
        for i in range(n_fuzz):
            name = f"fuzz{i}"
            clients[name] = ctx.Process(target=fuzzer, name=name, args=(
                name, address, seed * 100 + 50 + i, 80.0, victims, stop, marks, results))
            clients[name].start()
        t_start = time.monotonic()
        node.supervise(t_start + WARMUP_S)
        report["dispatcher_start"] = resources(node.procs["dispatcher"].pid)
        # The fault schedule, in seconds from the start of traffic.
        plan = [(rng.uniform(10, 20), "kill-worker")]
        while plan[-1][0] < duration - 10:
            plan.append((plan[-1][0] + rng.uniform(10, 20), "kill-worker"))
        plan += [(0.35 * duration, "kill-client"), (0.5 * duration, "kill-dispatcher")]
        plan = sorted(p for p in plan if p[0] < duration - 5) + [(duration, "end")]
        victim_pid, victim_segments, victim_killed_at, reaped_after = 0, [], 0.0, None
        for when, what in plan:
            target = t_start + when
            while time.monotonic() < target:
                node.supervise(min(target, time.monotonic() + 0.5))
                if victim_pid and reaped_after is None and not live_segments(victim_pid):
                    reaped_after = round(time.monotonic() - victim_killed_at, 2)
            if what == "kill-worker":
                w = rng.choice([w.name for w in node.node.workers])
                node.events.append({"t": node.at(), "event": "SIGKILL", "process": w, "pid": node.kill(w)})
            elif what == "kill-client":
                victim = clients["victim"]
                victim_pid, victim_segments = victim.pid, live_segments(victim.pid)
                os.kill(victim_pid, signal.SIGKILL)
                victim_killed_at = time.monotonic()
                node.events.append({"t": node.at(), "event": "SIGKILL", "process": "victim client",
                                    "pid": victim_pid, "segments": len(victim_segments)})
            elif what == "kill-dispatcher":
                report["dispatcher_before_kill"] = resources(node.procs["dispatcher"].pid)
                node.events.append({"t": node.at(), "event": "SIGKILL", "process": "dispatcher",
                                    "pid": node.kill("dispatcher")})
                marks[0] = time.monotonic()
                node.supervise(time.monotonic() + OUTAGE_S)  # reaps it; workers meanwhile keep dying/restarting
                node.restart_dispatcher()
                marks[1] = time.monotonic()
                report["dispatcher_restarted"] = resources(node.procs["dispatcher"].pid)
        report["load_avg_end"] = os.getloadavg()
        stop.set()
        per_client = []
        for _ in range(len(clients) - 1):  # the victim never reports
            per_client.append(results.get(timeout=120))
        for c in clients.values():
            c.join(timeout=30)
        report["clients"] = sorted(per_client, key=lambda r: r["name"])
        # The killed client's segments: reaped by the janitor while the dispatcher lives.
        end = time.monotonic() + REAP_WAIT_S
        while victim_pid and live_segments(victim_pid) and time.monotonic() < end:
            time.sleep(0.2)  # bounded wait for the janitor's next sweep (a timer, not a handshake)
        if victim_pid and reaped_after is None and not live_segments(victim_pid):
            reaped_after = round(time.monotonic() - victim_killed_at, 2)
        report["victim_client"] = {"pid": victim_pid, "segments_at_kill": len(victim_segments),
                                   "reaped_after_s": reaped_after, "left": live_segments(victim_pid)}
        report["dispatcher_end"] = resources(node.procs["dispatcher"].pid)
    finally:
        stop.set()
        report["exit_codes"] = node.stop()
        for c in clients.values():
            if c.is_alive():
                c.kill()
            c.join()
        report["events"] = node.events
        ours = node.pids_seen | {c.pid for c in clients.values() if c.pid}
        report["shm_left_ours"] = [s for pid in ours for s in live_segments(pid)]
        report["shm_left_any_pid"] = len(live_segments())  # other sessions' tests too: for context
        report["leftover_processes"] = leftover_processes(run_dir, ours)
        shutil.rmtree(run_dir, ignore_errors=True)
    return report


def verdict(report: dict) -> list[str]:
    """What a reader must look at: every check that failed, in words."""
    bad = []
    for c in report.get("clients", []):
        for key in ("never_answered", "duplicates", "duplicate_replies", "wrong_values", "unknown_ids",
                    "unmatched_replies"):
            if c.get(key):
                bad.append(f"{c['name']}: {key} = {c[key]}")
        if c["kind"] == "sdk":
            refused = sum(n for counts in c["by_phase"].values() for k, n in counts.items()
                          if k.startswith("PERMISSION_DENIED"))
            if refused:  # a valid client's own shared memory refused
                bad.append(f"{c['name']}: {refused} valid requests answered PERMISSION_DENIED "
                           f"(phases: { {ph: n.get('PERMISSION_DENIED', 0) for ph, n in c['by_phase'].items()} })")
        if c["kind"] == "fuzz":
            denied = c["statuses"].get("foreign-shm", {})
            if set(denied) - {"PERMISSION_DENIED"}:
                bad.append(f"{c['name']}: foreign shm references answered {denied}")
    for key in ("shm_left_ours", "leftover_processes"):
        if report.get(key):
            bad.append(f"{key}: {report[key]}")
    if report.get("victim_client", {}).get("left"):
        bad.append(f"killed client's segments not reaped: {report['victim_client']['left']}")
    return bad


def summary(report: dict) -> str:
    lines = [f"soak: {report['minutes']} min, {report['workers']} sim workers, load average "
             f"{tuple(round(x, 2) for x in report['load_avg_start'])} -> "
             f"{tuple(round(x, 2) for x in report.get('load_avg_end', ()))} on {report['cpus']} cpus", ""]
    lines.append(f"{'client':8} {'sent':>6} {'answered':>8} {'never':>5} {'dup':>3} {'late':>4}  statuses")
    for c in report.get("clients", []):
        if c["kind"] == "sdk":
            merged: dict[str, int] = {}
            for counts in c["by_phase"].values():
                for k, v in counts.items():
                    merged[k] = merged.get(k, 0) + v
            lines.append(f"{c['name']:8} {c['sent']:6} {c['answered']:8} {c['never_answered']:5} "
                         f"{c['duplicate_replies']:3} {c['late_replies']:4}  {merged}")
            for ph, counts in c["by_phase"].items():
                lines.append(f"{'':8}   {ph:>7}: {counts}")
            for u in c.get("unmatched_samples", []):
                lines.append(f"{'':8}   unmatched reply: {u}")
            for u in c.get("wrong_value_samples", []):
                lines.append(f"{'':8}   wrong value: {u}")
        else:
            a = c["anonymous"]
            lines.append(f"{c['name']:8} {c['sent_with_id']:6} {c['answered_once']:8} {c['never_answered']:5} "
                         f"{c['duplicates']:3} {'':4}  lost with dispatcher {c['lost_with_dispatcher']} "
                         f"(sent {c['lost_sent_at_s_from_kill']} s from kill); no-id {a['replies']}/{a['sent']} "
                         f"answered ({a['sent_in_outage']} sent in outage); lost kinds {c['lost_kinds']}")
            for kind, counts in sorted(c["statuses"].items()):
                lines.append(f"{'':8}   {kind:>11}: {counts}")
    lines.append("")
    for key in ("dispatcher_start", "dispatcher_before_kill", "dispatcher_restarted", "dispatcher_end"):
        if key in report:
            lines.append(f"{key:24} {report[key]}")
    lines.append(f"victim client            {report.get('victim_client')}")
    lines.append(f"/dev/shm left (ours)     {report['shm_left_ours']}  (any pid: {report['shm_left_any_pid']})")
    lines.append(f"leftover processes       {report['leftover_processes']}")
    lines.append(f"exit codes at stop       {report['exit_codes']}")
    kills = [e for e in report["events"] if e["event"] == "SIGKILL"]
    regs = [e["after_s"] for e in report["events"] if e["event"] == "re-registered"]
    lines.append(f"faults: {len(kills)} SIGKILLs; worker re-registrations {len(regs)} "
                 f"(max {max(regs, default=0)} s after restart)")
    bad = verdict(report)
    lines.append("verdict: " + ("all checks passed" if not bad else "FAILED\n  " + "\n  ".join(bad)))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--sdk-clients", type=int, default=3)
    ap.add_argument("--fuzzers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--json", default=str(RESULTS))
    args = ap.parse_args(argv)
    report = run(args.minutes, args.workers, args.sdk_clients, args.fuzzers, args.seed)
    report["verdict"] = verdict(report)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    print(summary(report))
    return 1 if report["verdict"] else 0


if __name__ == "__main__":
    sys.exit(main())
