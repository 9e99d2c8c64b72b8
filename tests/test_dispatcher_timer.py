"""The dispatcher's one-shot timer: every wake-up the decision asks for is armed."""

from __future__ import annotations

import itertools
import time

import zmq

from batchyard import server
from batchyard.config import DispatcherConfig
from batchyard.policy_core import Decision
from batchyard.server import Dispatcher

from conftest import SUM_MODEL


def test_a_wake_up_the_step_outlasted_is_still_armed(run_dir, monkeypatch):
    """The policy asks to decide again 100 us after its decision, and the step takes longer than
    that (a busy core). The wake-up was compared with the clock read after the step, found past,
    and dropped, and with it every later one (deadlines, housekeeping): a window of 100 us became
    a wait for the next message, up to a heartbeat interval."""
    ctx = zmq.Context()
    d = Dispatcher(DispatcherConfig(frontend=f"ipc://{run_dir}/fe", backend=f"ipc://{run_dir}/be"),
                   (SUM_MODEL.spec(),), ctx=ctx)
    try:
        base, reads = time.monotonic(), itertools.count(1)
        monkeypatch.setattr(server, "_now", lambda: base + 150e-6 * next(reads))  # each read 150 us on
        decided = []

        def policy(state, now):
            decided.append(now)
            return Decision(wake_at=now + 100e-6)

        monkeypatch.setattr(d.core.policy, "decide", policy)
        d._step_once()
        assert decided and d.timer.armed_at == decided[-1] + 100e-6
    finally:
        d.close()
        ctx.term()
