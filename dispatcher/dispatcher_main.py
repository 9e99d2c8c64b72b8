"""Entry point of the dispatcher process (``batchyard dispatcher``): process title, uvloop,
signals, the optional metrics endpoint, and the exit code."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from . import sd_notify, transport
from .config import NodeConfig
from .exit_codes import EX_CONFIG
from .server import Dispatcher

log = logging.getLogger("batchyard.dispatcher")


def run_dispatcher(node: NodeConfig) -> int:
    """Entry point of the dispatcher process. Returns its exit code after SIGTERM/SIGINT and a
    bounded drain (0), or after a broken invariant (EXIT_BROKEN_INVARIANT)."""
    import uvloop

    from .affinity import pin_node_process
    from .proctitle import set_title

    set_title("batchyard::dispatcher")
    cpus = pin_node_process(node.dispatcher.cpus, "dispatcher", log)  # before ZeroMQ's I/O thread starts
    if cpus is None:
        return EX_CONFIG
    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    profile = None
    if node.dispatcher.profile:
        from .cost_model import load_profile

        profile = load_profile(node.dispatcher.profile)
        log.info("cost curves from %s: %s", node.dispatcher.profile,
                 {f"{m}/{p}": c.describe() for (m, p), c in profile.items()})
    try:
        d = Dispatcher(node.dispatcher, tuple(m.spec() for m in node.models), profile=profile,
                       llm_models=tuple(m.name for m in node.llm_models))
    except transport.EndpointInUse as e:
        log.error("%s", e)
        return 1
    metrics_server = None
    if node.dispatcher.metrics_port:
        # Bound before the dispatcher starts and says it is ready: a port in use was a traceback,
        # after READY=1, and the ipc socket files were left behind.
        from .metrics import serve_metrics

        try:
            metrics_server = loop.run_until_complete(
                serve_metrics(loop, node.dispatcher.metrics_host, node.dispatcher.metrics_port, d.render_metrics))
        except OSError as e:
            log.error("[dispatcher] metrics_port %d: cannot listen on %s: %s", node.dispatcher.metrics_port,
                      node.dispatcher.metrics_host, e.strerror or e)
            d.close()
            loop.close()
            d.ctx.term()
            return 1
        log.info("metrics at http://%s:%d/metrics", node.dispatcher.metrics_host, node.dispatcher.metrics_port)
    d.start(loop)

    async def serve_until_stopped() -> None:
        # The handlers and READY=1 from inside the running loop: uvloop hears a signal only
        # through the self-pipe it sets up while it runs, and a SIGTERM that came between READY=1
        # and the run was lost (systemd's stop then waited for its SIGKILL, the sockets left).
        # SIGHUP too (a terminal closed on a dispatcher run by hand): by its default action
        # the queue failed, and the socket files were left.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, d.begin_shutdown)
        ready = sd_notify.announce_ready(loop)  # READY=1 (sockets bound), then WATCHDOG=1 from this loop
        log.info("dispatcher pid %d: clients at %s, workers at %s, policy %s, cpus %s",
                 os.getpid(), node.dispatcher.frontend, node.dispatcher.backend, d.policy.name, cpus)
        for name in node.unserved_models():
            log.warning("model %r is served by none of the config's [[workers]]: no worker of this node can "
                        "register for it, and its requests wait in the queue until their timeout (then UNAVAILABLE)", name)
        try:
            await d.stopped
        finally:
            ready.close()

    try:
        loop.run_until_complete(serve_until_stopped())
    finally:
        if metrics_server is not None:
            metrics_server.close()
            loop.run_until_complete(metrics_server.wait_closed())
        d.close()
        loop.close()
        # Flush what the last step sent (a drained batch's replies) before the process exits:
        # term() waits for each socket's linger (500 ms at most); without it they are dropped.
        d.ctx.term()
    return d.exit_code
