"""Replies to a client whose queue is full wait for room; streamed tokens are dropped instead.

A streamed generation sends a message an engine step: a client reading slower than its streams
came filled its queue (ZeroMQ's high-water marks), and the dispatcher's client ROUTER dropped
the generation's one `generated` reply like its tokens; the client waited out its timeout and
was told the dispatcher did not answer (an outside review: 4 streams of 65,536 tokens, a client
that read late, the fourth reply lost)."""

from __future__ import annotations

import errno
import math

import pytest
import zmq

from batchyard import protocol as P
from batchyard.client_replies import HELD_GIVE_UP_S, HELD_RETRY_MAX_S, HELD_RETRY_S, ClientReplies

HWM = 4


def _pair(run_dir, ctx, identity=b"client"):
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.SNDHWM, HWM)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"ipc://{run_dir}/r")
    dealer = _dealer(ctx, f"ipc://{run_dir}/r", identity)
    return router, dealer


def _dealer(ctx, address: str, identity: bytes):
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, identity)
    dealer.setsockopt(zmq.RCVHWM, HWM)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(address)
    return dealer


def _connected(router, dealer) -> None:
    dealer.send(b"hello")
    assert router.poll(10_000) and router.recv_multipart()[1] == b"hello"


def _drain(dealer) -> list:
    got = []
    while dealer.poll(0 if got else 200):
        got.append(dealer.recv())
    return got


def _until_sent(step, dealer, done, tries: int = 100) -> list:
    """What the client reads while ``step`` (a flush) runs, until ``done(got)``. Messages sent
    reach it in bursts, as ZeroMQ's I/O threads move them (and a socket learns of room its peer
    made through commands it reads at its next send)."""
    got = _drain(dealer)
    for _ in range(tries):
        if done(got):
            break
        step()
        got += _drain(dealer)
    return got


def _has_reply(raw: list) -> bool:
    return any(type(P.reply_decoder.decode(m)) is P.GenerateReply for m in raw)


def test_a_reply_past_a_full_queue_is_held_and_sent_once_in_order_and_tokens_are_dropped(run_dir):
    ctx = zmq.Context()
    router, dealer = _pair(run_dir, ctx)
    try:
        _connected(router, dealer)
        replies = ClientReplies(router)
        for i in range(200):  # far past both queues and the kernel's buffers (64 KiB each)
            replies.send_droppable(b"client", b"token %d " % i + bytes(64 << 10))
        assert replies.tokens_dropped > 0
        for i in range(3):
            replies.send(b"client", b"reply %d" % i)
        assert replies.holding
        replies.send_droppable(b"client", b"token late")  # (behind held replies: dropped)
        got = _until_sent(lambda: replies.flush(force=True), dealer, lambda got: b"reply 2" in got)
        assert not replies.holding
        assert [g for g in got if g.startswith(b"reply")] == [b"reply 0", b"reply 1", b"reply 2"]
        assert len(got) == 201 - replies.tokens_dropped + 3 and not any(g.startswith(b"token late") for g in got)
    finally:
        dealer.close()
        router.close()
        ctx.term()


class _FullQueue:
    """A client ROUTER whose queue to every client is full (``gone``: no client connected)."""

    def __init__(self):
        self.gone, self.sends = False, 0

    def setsockopt(self, *args):
        pass

    def send(self, part, flags=0, copy=True):
        self.sends += 1
        raise zmq.ZMQError(errno.EHOSTUNREACH) if self.gone else zmq.Again()


def test_held_replies_are_tried_less_often_while_none_is_taken_and_let_go_after_a_minute():
    """ZeroMQ may keep the queue of a client that left with messages in flight full for ever
    (no EHOSTUNREACH; seen with real sockets): its held replies would have been tried for ever,
    and at every step of the dispatcher."""
    now = [0.0]
    queue = _FullQueue()
    replies = ClientReplies(queue, clock=lambda: now[0])
    assert replies.next_try() == math.inf
    replies.send(b"client", b"reply 0")
    replies.send(b"client", b"reply 1", b"its tensor frame")
    assert replies.holding and replies.next_try() == HELD_RETRY_S
    for tries in range(1, 12):  # none taken: each try waits twice as long, up to a bound
        sends = queue.sends
        replies.flush(now[0] + 1e-9)  # (before the next try: no send)
        assert queue.sends == sends
        now[0] = replies.next_try()
        replies.flush()
        assert queue.sends == sends + 1
        assert replies.next_try() - now[0] == pytest.approx(min(HELD_RETRY_MAX_S, HELD_RETRY_S * 2 ** tries))
    now[0] = HELD_GIVE_UP_S - 1
    replies.flush()
    assert replies.holding
    now[0] = HELD_GIVE_UP_S + 1
    replies.flush()
    assert not replies.holding and replies.replies_dropped == 2


def test_held_replies_of_a_client_said_gone_are_dropped_at_once():
    queue = _FullQueue()
    replies = ClientReplies(queue)
    replies.send(b"client", b"reply")
    queue.gone = True  # (EHOSTUNREACH: ZeroMQ saw its connection close)
    replies.flush(force=True)
    assert not replies.holding
    replies.send(b"nobody", b"reply")
    assert not replies.holding


def test_a_streamed_generations_reply_reaches_a_client_that_read_late(bare_dispatcher, run_dir, monkeypatch):
    from batchyard import server
    from test_llm_core import GPU_ENGINE  # model "m", role "gpu"

    monkeypatch.setattr(server, "QUEUE_HWM", HWM)  # (100,000 messages otherwise)
    d = bare_dispatcher()
    d.llm._send_worker = lambda identity, header: True
    ctx = zmq.Context()
    client = _dealer(ctx, d.cfg.frontend, b"client")
    try:
        client.send(P.encode(P.StatusRequest(v=P.PROTOCOL_VERSION, id=99)))
        assert d.frontend.poll(10_000)
        d._step_once()
        assert client.poll(10_000) and type(P.reply_decoder.decode(client.recv())) is P.StatusReply
        d.llm.on_register(P.Register(v=P.PROTOCOL_VERSION, worker="gpu0", pid=1, path="gpu", models=[],
                                     llm=GPU_ENGINE), b"gpu0", 0.0)
        d.llm.on_generate(P.GenerateRequest(v=P.PROTOCOL_VERSION, id=1, model="m", prompt=[7] * 8, max_tokens=1000,
                                            stream=True, timeout_us=30_000_000), b"client", 0.0, lambda m: "")
        d.llm.decide(0.0)
        [job] = d.llm.core.jobs.values()
        tokens = list(range(1000))
        for _ in range(400):  # engine steps none of which the client read (3 KB each: past the kernel's buffers)
            d.llm.on_tokens(P.LlmTokens(job_id=job.job_id, worker="gpu0", seq=job.requests[0].seq, start=0,
                                        tokens=tokens))
        d.llm.on_done(P.LlmDone(job_id=job.job_id, worker="gpu0", compute_s=0.1, results=[
            P.LlmResult(seq=job.requests[0].seq, status=0, tokens=tokens, first_token_s=0.001)]), 0.1)
        # (the dispatcher's next steps send what was held)
        got = [P.reply_decoder.decode(m) for m in _until_sent(d._step_once, client, _has_reply)]
        [reply] = [m for m in got if type(m) is P.GenerateReply]
        assert (reply.id, reply.status, reply.tokens) == (1, 0, tokens)
        assert 0 < sum(type(m) is P.GenerateTokens for m in got) < 400  # (some dropped: the reply has them)
    finally:
        client.close()
        ctx.term()


def test_a_batchs_replies_reach_its_other_clients_when_one_client_is_gone(run_dir):
    """With ROUTER_MANDATORY on the client socket, a batch's replies sent as before, blocking,
    raised EHOSTUNREACH at a client that was gone: the batch's later requests were never answered
    (and blocked the dispatcher's thread where a client's queue was full)."""
    import time

    import numpy as np

    from batchyard.config import DispatcherConfig
    from batchyard.server import Dispatcher
    from conftest import SUM_MODEL

    ctx = zmq.Context()
    d = Dispatcher(DispatcherConfig(frontend=f"ipc://{run_dir}/fe", backend=f"ipc://{run_dir}/be"),
                   (SUM_MODEL.spec(),), ctx=ctx)
    worker = ctx.socket(zmq.DEALER)
    worker.setsockopt(zmq.LINGER, 0)
    worker.connect(d.cfg.backend)
    client = _dealer(ctx, d.cfg.frontend, b"here")
    try:
        worker.send(P.encode(P.Register(v=P.PROTOCOL_VERSION, worker="w0", pid=1, path="cpu",
                                        models=[SUM_MODEL.spec()])))
        assert d.backend.poll(10_000)
        d._step_once()
        assert worker.poll(10_000) and type(P.to_worker_decoder.decode(worker.recv())) is P.Registered
        x = np.ones((1, 4), np.float32)
        for identity, rid in ((b"gone", 1), (b"here", 2)):  # ("gone": no such client connected)
            header = P.encode(P.InferRequest(v=P.PROTOCOL_VERSION, id=rid, model="sum", inputs=[
                P.TensorRef(name="x", dtype="float32", shape=[1, 4], frame=0)]))
            d._on_client_message([zmq.Frame(identity), zmq.Frame(header), zmq.Frame(x.tobytes())], time.monotonic())
        d._step_once()  # (both queued: one batch of the two to the free worker)
        assert worker.poll(10_000)
        frames = worker.recv_multipart()
        batch = P.to_worker_decoder.decode(frames[0])
        assert type(batch) is P.Batch and len(batch.seqs) == 2
        worker.send_multipart([P.encode(P.BatchDone(batch_id=batch.batch_id, worker="w0", compute_us=100, results=[
            P.ItemResult(seq=s, status=0, n_frames=1, outputs=[P.TensorRef(name="y", dtype="float32", shape=[1, 2],
                                                                           frame=0)]) for s in batch.seqs])),
                               *[np.full((1, 2), 7, np.float32)] * 2])
        assert d.backend.poll(10_000)
        d._step_once()
        assert client.poll(10_000)
        reply = P.reply_decoder.decode(client.recv_multipart()[0])
        assert (reply.id, reply.status) == (2, 0)
    finally:
        for s in (worker, client):
            s.close()
        d.close()
        ctx.term()
