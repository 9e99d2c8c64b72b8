"""The client processes of the soak (bench/soak.py): SDK clients sending valid requests, and
fuzzers sending malformed or hostile messages from raw ZeroMQ DEALER sockets.

Each runs in its own (spawned) process until ``stop`` is set, then drains what it has in
flight and puts one accounting dict on ``results``. ``marks`` holds CLOCK_MONOTONIC times
(shared by every process on the host) of the dispatcher's kill and of its replacement being
ready, so each side can say which of its requests were in flight across the outage.
"""

from __future__ import annotations

import collections
import random
import time
from concurrent.futures import FIRST_COMPLETED, wait

import msgpack
import numpy as np
import zmq

from batchyard import protocol as P
from batchyard.client import Client
from batchyard.errors import BatchyardError, DeadlineExceeded, Unavailable
from batchyard.shm import live_segments

SUM_SHAPE = (4,)
BIG_SHAPE = (256, 1024)  # 1 MiB of float32 per item: always through shared memory
DRAIN_S = 30.0  # after stop: how long in-flight requests may take (> the longest timeout + grace)
# Fuzzer ids start high: a random byte string that happens to decode to a map with a small id
# must not be mistaken for one of ours.
FUZZ_ID_BASE = 10**12
LOST_SLACK_S = 2.0


def phase(t: float, marks) -> str:
    """Where time ``t`` falls relative to the dispatcher's kill: before, outage, after."""
    killed, ready = marks[0], marks[1]
    if not killed or t < killed:
        return "before"
    if not ready or t < ready:
        return "outage"
    return "after"


# ------------------------------------------------------------------ SDK client
def _outcome(fut) -> tuple[str, str]:
    """(status label, message) of a settled future; local failures get their own labels."""
    try:
        fut.result(timeout=0)
    except Unavailable as e:
        return ("UNAVAILABLE(lost connection)" if "lost the connection" in e.message else "UNAVAILABLE"), e.message
    except DeadlineExceeded as e:
        return ("DEADLINE_EXCEEDED(local)" if "no reply from the dispatcher" in e.message
                else "DEADLINE_EXCEEDED"), e.message
    except BatchyardError as e:
        return e.status.name, e.message
    except Exception as e:  # noqa: BLE001 — anything else is itself a finding
        return f"raised {type(e).__name__}", str(e)
    return "OK", ""


class _ReplyWatch:
    """Counts replies the SDK drops silently: a second reply for an id (duplicate), a reply
    after the local deadline (late), or one for an id it never had in flight (unmatched)."""

    def __init__(self, codec):
        self.codec = codec
        self.seen: set[int] = set()
        self.duplicates = self.late = self.releases = 0
        self.unmatched: list[tuple] = []  # (id, status, message, when)
        self._orig = codec.on_reply
        codec.on_reply = self.on_reply  # the I/O thread looks it up on the instance

    def on_reply(self, frames) -> None:
        try:
            msg = P.reply_decoder.decode(frames[0])
            rid = msg.id
        except P.DecodeError:
            msg, rid = None, None
        if type(msg) is P.Release:
            self.releases += 1  # the second message for an id answered in flight: expected
        elif rid is not None:
            if rid in self.seen:
                self.duplicates += 1
            # Infer replies only: a spec's or status's late reply leaves the SDK no trace to match
            # (a submit whose spec fetch timed out locally had its late reply counted "unmatched").
            elif rid not in self.codec.pending and type(msg) is P.InferReply:
                if rid in self.codec.late:
                    self.late += 1
                else:
                    self.unmatched.append((rid, P.Status(msg.status).name, msg.message[:120], time.monotonic()))
            self.seen.add(rid)
        self._orig(frames)


def _request(rng: random.Random, big_share: float):
    """(model, inputs, expected output value per item) with random small-integer contents."""
    r = rng.random()
    if r < 0.02:
        return "no-such-model", {"x": np.ones((1, 4), np.float32)}, None
    if r < 0.02 + big_share:
        n = rng.choice((1, 1, 2))
        x = np.zeros((n, *BIG_SHAPE), np.float32)
        vals = [rng.randrange(1, 1000) for _ in range(n)]
        for i, v in enumerate(vals):
            x[i, rng.randrange(BIG_SHAPE[0]), rng.randrange(BIG_SHAPE[1])] = v
        return "big", {"x": x}, vals
    n = rng.choice((1, 1, 1, 2, 4, 8))
    x = np.array([[rng.randrange(0, 100) for _ in range(SUM_SHAPE[0])] for _ in range(n)], np.float32)
    return "sum", {"x": x}, [float(row.sum()) for row in x]


def _timeout(rng: random.Random) -> float:
    r = rng.random()
    if r < 0.08:
        return rng.uniform(0.002, 0.02)  # often too short: the dispatcher answers DEADLINE_EXCEEDED
    if r < 0.25:
        return rng.uniform(0.05, 0.5)
    return rng.uniform(1.0, 5.0)


def sdk_client(name: str, address: str, seed: int, rate: float, window: int, big_share: float,
               stop, marks, results) -> None:
    rng = random.Random(seed)
    by_phase: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    by_model: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    samples: dict[str, str] = {}
    sent = raised_at_submit = wrong_values = 0
    inflight: dict = {}  # future -> (model, expected, submitted at)
    wrong: list[dict] = []
    failed: dict[int, tuple] = {}  # request id -> (label, settled at) of those that ended in an error

    def settle(fut) -> None:
        nonlocal wrong_values
        model, expected, t0 = inflight.pop(fut)
        label, message = _outcome(fut)
        if label == "OK" and expected is not None:
            y = fut.result()["y"]
            for i, v in enumerate(expected):
                if not np.all(y[i] == np.float32(v)):
                    wrong_values += 1
                    if len(wrong) < 5:
                        wrong.append({"model": model, "item": i, "of": len(expected), "expected": v,
                                      "got": np.unique(y[i])[:4].tolist(), "phase": phase(t0, marks)})
                    break
        by_phase[phase(t0, marks)][label] += 1
        by_model[model][label] += 1
        if label != "OK":
            samples.setdefault(label, message[:200])
            failed[fut.id] = (label, time.monotonic())

    with Client(address) as client:
        watch = _ReplyWatch(client._codec)
        next_send = time.monotonic()
        while not stop.is_set():
            now = time.monotonic()
            if now >= next_send and len(inflight) < window:
                next_send = max(next_send + rng.expovariate(rate), now - 1.0)
                model, inputs, expected = _request(rng, big_share)
                priority = rng.choice(("high", "normal", "low"))
                sent += 1
                try:
                    fut = client.submit(model, inputs, priority=priority, timeout=_timeout(rng))
                except BatchyardError as e:  # model_info or shm registration failed: explicit too
                    raised_at_submit += 1
                    label = f"{e.status.name}(at submit)"
                    by_phase[phase(now, marks)][label] += 1
                    by_model[model][label] += 1
                    samples.setdefault(label, e.message[:200])
                    continue
                inflight[fut] = (model, expected, now)
                continue
            timeout = max(0.0, next_send - now) if len(inflight) < window else 0.5
            done, _ = wait(list(inflight), timeout=min(timeout, 0.5), return_when=FIRST_COMPLETED)
            for fut in done:
                settle(fut)
        done, not_done = wait(list(inflight), timeout=DRAIN_S)
        for fut in done:
            settle(fut)
        never = len(not_done)
        for fut in not_done:
            samples.setdefault("NEVER_ANSWERED", f"{inflight[fut][0]} submitted at phase {phase(inflight[fut][2], marks)}")
    # A reply the SDK could not match: how had this client settled that request, and when? A
    # local deadline without shared memory leaves no trace in the SDK (no regions to hold), so
    # its late reply lands here: count it as late. The rest are replies to requests the SDK had
    # already failed (e.g. UNAVAILABLE on a lost connection) or never sent.
    unmatched = []
    for rid, st, msg, t in watch.unmatched:
        label, settled = failed.get(rid, ("never in flight", t))
        if label == "DEADLINE_EXCEEDED(local)":
            watch.late += 1
        else:
            unmatched.append({"id": rid, "reply": f"{st} {msg}", "settled_as": label,
                              "reply_after_settle_s": round(t - settled, 3), "phase": phase(t, marks)})
    results.put({"name": name, "kind": "sdk", "unmatched_samples": unmatched[:5], "sent": sent, "raised_at_submit": raised_at_submit,
                 "by_phase": {k: dict(v) for k, v in by_phase.items()},
                 "by_model": {k: dict(v) for k, v in by_model.items()},
                 "answered": sum(sum(c.values()) for c in by_phase.values()) - raised_at_submit,
                 "never_answered": never, "wrong_values": wrong_values,
                 "duplicate_replies": watch.duplicates, "late_replies": watch.late,
                 "unmatched_replies": len(unmatched), "wrong_value_samples": wrong,
                 "samples": samples})


# ------------------------------------------------------------------ fuzzer
VALID = {"type": "infer", "v": 1, "id": 0, "model": "sum",
         "inputs": [{"name": "x", "dtype": "float32", "shape": [1, 4], "frame": 0}]}
X1 = np.ones((1, 4), np.float32).tobytes()
_OTHER_TYPES = ("status", "model_info", "bogus", "result", "shm_register", "shm_unregister", "cancel")


def _text(rng: random.Random, n: int = 8) -> str:
    return "".join(chr(rng.choice((rng.randrange(32, 127), rng.randrange(0xA0, 0xD7FF))))
                   for _ in range(rng.randrange(n + 1)))


def _value(rng: random.Random, depth: int = 0):
    """A random msgpack-able value: scalars at the edges of their types, nested a little."""
    r = rng.randrange(10 if depth < 2 else 8)
    if r == 0:
        return None
    if r == 1:
        return rng.random() < 0.5
    if r == 2:
        return rng.choice((0, -1, 1, 2**31, -2**63, 2**63 - 1, 2**64 - 1, rng.randrange(-2**40, 2**40)))
    if r == 3:
        return rng.choice((float("nan"), float("inf"), -0.0, 1e308, rng.uniform(-1e6, 1e6)))
    if r in (4, 5):
        return _text(rng)
    if r in (6, 7):
        return rng.randbytes(rng.randrange(9))
    if r == 8:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {_text(rng, 6): _value(rng, depth + 1) for _ in range(rng.randrange(5))}


def _mutated(rng: random.Random, base: dict) -> dict:
    h = dict(base)
    key = rng.choice(sorted(h) + ["extra"])
    if rng.random() < 0.5:
        h.pop(key, None)
    else:
        h[key] = _value(rng)
    return h


def _foreign_refs(rng: random.Random, victims: list[int]) -> dict:
    """An infer naming shared memory this connection never registered: another client's
    segment, or a name that does not exist. Must be answered PERMISSION_DENIED."""
    names = [s for pid in victims for s in live_segments(pid)] or ["batchyard_1_0badc0ffee"]
    seg = rng.choice(names + ["batchyard_999999_deadbeef", "not_ours"])
    ref = {"segment": seg, "offset": rng.choice((0, 64, 4096)), "nbytes": 256 * 1024 * 4}
    if rng.random() < 0.5:  # read someone's memory as input
        return {"type": "infer", "v": 1, "model": "big",
                "inputs": [{"name": "x", "dtype": "float32", "shape": [1, *BIG_SHAPE], "shm": ref}]}
    # ... or have a worker write into it as output
    return {**VALID, "outputs": {"y": {**ref, "nbytes": 16}}}


def fuzz_message(rng: random.Random, rid: int, victims: list[int]) -> tuple[str, list[bytes]]:
    """(kind, frames). Map headers carry ``rid``; a cancel becomes a status (no reply of its own)."""
    kind = rng.choice(("bytes", "map", "mutate", "mutate", "non-utf8", "other-type", "valid", "foreign-shm"))
    frames = [rng.randbytes(rng.randrange(33)) for _ in range(rng.randrange(3))]
    if kind == "bytes":
        return kind, [rng.randbytes(rng.randrange(65)), *frames]
    if kind == "map":
        h = {_text(rng, 8): _value(rng) for _ in range(rng.randrange(7))}
    elif kind == "other-type":
        h = _mutated(rng, {"type": rng.choice(_OTHER_TYPES), "v": 1, "id": 0, "model": "sum",
                           "segment": "batchyard_999999_deadbeef", "proved": rng.random() < 0.5})
    elif kind == "foreign-shm":
        h, frames = _foreign_refs(rng, victims), [X1]
    elif kind == "valid":
        h, frames = dict(VALID), [X1]
    else:
        h = _mutated(rng, VALID)
        frames = [X1, *frames[:1]]
    if h.get("type") == "cancel":
        h["type"] = "status"
    h["id"] = rid
    if kind == "non-utf8":
        h["model"] = b"s\xffm"  # packed as a str (use_bin_type=False) that is not UTF-8
        return kind, [msgpack.packb(h, use_bin_type=False), *frames]
    return kind, [msgpack.packb(h), *frames]


def fuzzer(name: str, address: str, seed: int, rate: float, victims: list[int], stop, marks, results) -> None:
    rng = random.Random(seed)
    sent_at: dict[int, float] = {}
    kind_of: dict[int, str] = {}
    replies: collections.Counter = collections.Counter()
    statuses: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    anonymous = {"sent": 0, "sent_in_outage": 0, "replies": 0}
    unknown_ids = 0
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    next_id = FUZZ_ID_BASE

    def receive(timeout_ms: int) -> None:
        nonlocal unknown_ids
        if not sock.poll(timeout_ms):
            return
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            reply = P.reply_decoder.decode(frames[0])
            if reply.id is None:
                anonymous["replies"] += 1
                statuses["(no id)"][P.Status(reply.status).name] += 1
            elif reply.id in sent_at:
                replies[reply.id] += 1
                statuses[kind_of[reply.id]][P.Status(reply.status).name] += 1
            else:
                unknown_ids += 1

    next_send = time.monotonic()
    while not stop.is_set():
        now = time.monotonic()
        if now >= next_send:
            next_send = max(next_send + rng.expovariate(rate), now - 1.0)
            kind, frames = fuzz_message(rng, next_id, victims)
            rid = P.salvage_id(frames[0])
            if rid is not None and rid != next_id:
                continue  # random bytes that decode to a map with an id: not ours to count
            if rid is None:
                anonymous["sent"] += 1
                anonymous["sent_in_outage"] += phase(now, marks) == "outage"
            else:
                sent_at[rid], kind_of[rid] = now, kind
                next_id += 1
            sock.send_multipart(frames)
        receive(max(0, int((next_send - time.monotonic()) * 1000)))
    # Drain: until every id is answered or DRAIN_S passes, then a status request as a barrier
    # (its reply comes after everything sent before it was decided on) and a short linger.
    end = time.monotonic() + DRAIN_S
    while time.monotonic() < end and len(replies) < len(sent_at):
        receive(200)
    barrier = next_id
    sent_at[barrier], kind_of[barrier] = time.monotonic(), "barrier"
    sock.send_multipart([msgpack.packb({"type": "status", "v": 1, "id": barrier})])
    end = time.monotonic() + 10.0
    while time.monotonic() < end and not replies[barrier]:
        receive(200)
    receive(1000)
    sock.close(linger=0)
    ctx.term()
    missing = [rid for rid in sent_at if not replies[rid]]
    killed, ready = marks[0], marks[1]
    # In flight when the dispatcher died: sent shortly before its kill (anything older had
    # long been answered, fast sim workers) up to its replacement being ready.
    lost = [rid for rid in missing if killed and killed - LOST_SLACK_S <= sent_at[rid] < (ready or float("inf"))]
    results.put({"name": name, "kind": "fuzz", "sent_with_id": len(sent_at), "anonymous": anonymous,
                 "answered_once": sum(1 for n in replies.values() if n == 1),
                 "duplicates": sum(1 for n in replies.values() if n > 1),
                 "lost_with_dispatcher": len(lost),
                 "lost_sent_at_s_from_kill": ([round(min(sent_at[r] for r in lost) - killed, 3),
                                               round(max(sent_at[r] for r in lost) - killed, 3)] if lost else []),
                 "never_answered": len(missing) - len(lost),
                 "lost_kinds": dict(collections.Counter(kind_of[r] for r in lost)),
                 "never_answered_kinds": dict(collections.Counter(kind_of[r] for r in missing if r not in lost)),
                 "unknown_ids": unknown_ids, "statuses": {k: dict(v) for k, v in statuses.items()}})
