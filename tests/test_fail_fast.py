"""A broken invariant (an exception outside any one message's handling) must not leave the
dispatcher serving on half-applied state: every open request is answered UNAVAILABLE and the
process exits 70 (restartable), so `up`/systemd start a clean one."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import uvloop
import zmq

from batchyard import protocol as P
from batchyard.config import DispatcherConfig
from batchyard.server import EXIT_BROKEN_INVARIANT, Dispatcher

from conftest import SUM_MODEL


def test_an_exception_in_the_decision_step_answers_everyone_and_exits_70(run_dir):
    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    ctx = zmq.Context()
    d = Dispatcher(DispatcherConfig(frontend=f"ipc://{run_dir}/fe", backend=f"ipc://{run_dir}/be"),
                   (SUM_MODEL.spec(),), ctx=ctx)
    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(f"ipc://{run_dir}/fe")
    try:
        d.start(loop)
        header = {"type": "infer", "v": 1, "model": "sum",
                  "inputs": [{"name": "x", "dtype": "float32", "shape": [1, 4], "frame": 0}]}
        x = np.ones((1, 4), np.float32).tobytes()
        # No worker: both requests are admitted and wait in the queue.
        for rid in (1, 2):
            client.send_multipart([msgspec.msgpack.encode({**header, "id": rid}), x])

        def broken_policy(state, now):
            if state.queued_requests() == 2:
                raise RuntimeError("a bug in the policy")
            return real(state, now)

        real = d.core.policy.decide
        d.core.policy.decide = broken_policy
        loop.run_until_complete(asyncio.wait_for(d.stopped, 10))
        replies = []
        while client.poll(2000):
            replies.append(P.reply_decoder.decode(client.recv_multipart()[0]))
            if len(replies) == 2:
                break
        assert sorted(r.id for r in replies) == [1, 2]
        assert all(r.status == P.Status.UNAVAILABLE for r in replies)
        assert d.exit_code == EXIT_BROKEN_INVARIANT
    finally:
        client.close()
        d.close()
        ctx.term()
        loop.close()
        asyncio.set_event_loop(None)
