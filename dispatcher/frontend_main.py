"""Entry point of a front-door process (``batchyard frontend``, title ``batchyard::frontend``):
one asyncio loop running grpc.aio's KServe server, the aiohttp KServe REST app, and the
Batchyard ``AsyncClient`` both translate onto. The dispatcher stays one thread and never sees
gRPC or HTTP. Several of these processes bind the same ports (SO_REUSEPORT) so the front door
is never the bottleneck; `batchyard up` starts ``[frontend] processes`` of them. Only the
processes of one node share them: another node's front door on those ports exits at its start
(kserve_shm.PortClaim).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from .config import NodeConfig
from .exit_codes import EX_CONFIG
from .transport import is_tcp, node_client_keys

log = logging.getLogger("batchyard.frontend")
STOP_GRACE_S = 5.0  # on SIGTERM, how long gRPC calls and HTTP requests in flight may finish
# Of that grace, the last part: those still waiting on the node are answered UNAVAILABLE then,
# before their connections close at its end.
ANSWER_THE_REST_S = 1.0
# How often a front door closes the segments of regions another process of the node unregistered
# (ShmRegions.sweep): a bound on how long a client's unlinked memory stays allocated.
SHM_SWEEP_S = 1.0


async def serve(node: NodeConfig, stop: asyncio.Event) -> None:
    """Serve until ``stop`` is set, then close everything this started. Another node's front
    doors on these ports (``PortsTaken``, an OSError) are found before anything binds them or
    joins their shared-memory registry."""
    from .kserve_shm import claim_ports

    fe = node.frontend
    # The dispatcher's endpoint names the node: every front door of one node is given it, and
    # two nodes cannot both serve one.
    claim = claim_ports(node.dispatcher.frontend, fe.host, (("gRPC", fe.grpc_port), ("HTTP", fe.http_port)))
    try:
        await _serve(node, stop)
    finally:
        if claim is not None:
            claim.close()


async def _serve(node: NodeConfig, stop: asyncio.Event) -> None:
    from .client_async import AsyncClient
    from .kserve_common import KServeCore
    from .kserve_shm import NODE_INSTANCE_ENV, open_registry, registry_dir
    from .kserve_logging import LogSettings, setting_of_level
    from .kserve_trace import Setting, Tracer, trace_file_problem
    from .sd_notify import announce_ready

    fe, d = node.frontend, node.dispatcher
    # Over tcp the dispatcher takes shared memory only where the node allows it (the front door
    # is no client it can vouch for there); otherwise every tensor goes inline.
    over_tcp = is_tcp(d.frontend)
    if over_tcp and not d.allow_shm_over_tcp:
        log.warning("the dispatcher's client endpoint %s is tcp, without [dispatcher] allow_shm_over_tcp: tensors "
                    "go to it inline, so a request carries at most [dispatcher] max_inline_bytes (%d) of them, not "
                    "[frontend] max_request_bytes; an ipc frontend (or allow_shm_over_tcp) lifts that",
                    d.frontend, d.max_inline_bytes)
    client = AsyncClient(d.frontend, shared_memory=True if over_tcp and d.allow_shm_over_tcp else None,
                         **node_client_keys(d, d.frontend))
    # One shared-memory registry for every front-door process on these ports (Triton's is server-wide),
    # which also holds the node's statistics and trace setting.
    shm = open_registry(registry_dir(fe.host, fe.grpc_port, fe.http_port), os.environ.get(NODE_INSTANCE_ENV, ""))
    tracer = Tracer(Setting((fe.trace_level,), fe.trace_rate, fe.trace_count, fe.trace_log_frequency), fe.trace_file,
                    shm.dir_fd, node_clock=not over_tcp)
    if fe.trace_file and (why := trace_file_problem(fe.trace_file)):
        log.error("[frontend] trace_file %s: %s; traces will not be written", fe.trace_file, why)
    logs = LogSettings(setting_of_level(logging.getLogger().getEffectiveLevel()), shm.dir_fd)
    core = KServeCore(client, shm, default_timeout_s=node.dispatcher.default_timeout_s,
                      strict_readiness=fe.strict_readiness, llm_models=frozenset(m.name for m in node.llm_models),
                      tracer=tracer, logs=logs)
    llm_routes: tuple = ()  # the LLM mode's OpenAI routes
    if node.llm_models:  # the LLM mode: OpenAI's completions, and Triton's protocols as its vLLM backend's
        from .llm_generate import LlmGenerate
        from .llm_model_files import generation_defaults
        from .openai_chat import OpenAiChat
        from .openai_health import OpenAiHealth
        from .openai_http import OpenAiCompletions
        from .openai_tokenize import OpenAiTokenize

        completions = OpenAiCompletions(
            client, {m.name: m.path for m in node.llm_models}, node.dispatcher.default_timeout_s,
            stopping=lambda: core.stopping, max_model_len={m.name: m.max_model_len for m in node.llm_models},
            # (checked by the config's validation, which names a bad field)
            defaults={m.name: generation_defaults(m.path) for m in node.llm_models if m.generation_config == "auto"})
        core.llm = LlmGenerate(completions)
        chat = OpenAiChat(completions)
        llm_routes = (*completions.routes(), *chat.routes(), *OpenAiTokenize(chat).routes(),
                      *OpenAiHealth(core, completions).routes())
    grpc_server = http_runner = watchdog = None
    loop = asyncio.get_running_loop()

    def sweep_regions() -> None:
        nonlocal sweeper
        sweeper = loop.call_later(SHM_SWEEP_S, sweep_regions)  # first: whatever fails below, it runs again
        try:
            core.shm.sweep()
        except OSError:
            log.exception("shared-memory regions could not be swept")
        logs.follow()  # a log setting made through another front-door process of the node

    sweeper = loop.call_later(SHM_SWEEP_S, sweep_regions)
    try:
        tls = None
        if fe.grpc_port and fe.grpc_tls_cert:  # (before anything serves: a file it cannot use stops it)
            from .kserve_tls import server_credentials

            tls = server_credentials(fe.grpc_tls_cert, fe.grpc_tls_key, fe.grpc_tls_client_ca)
        # HTTP first: a client that sees the gRPC port ready finds HTTP ready too (tests wait so).
        if fe.http_port:
            from .kserve_http import start_http

            http_runner = await start_http(core, fe.host, fe.http_port, fe.max_request_bytes,
                                           extra_routes=llm_routes,
                                           idle_timeout_s=fe.idle_timeout_s, restricted_apis=fe.restricted_apis)
        if fe.grpc_port:
            from .kserve_grpc import start_grpc

            grpc_server = await start_grpc(core, fe.host, fe.grpc_port, fe.max_request_bytes, fe.idle_timeout_s,
                                           restricted_apis=fe.restricted_apis, credentials=tls)
        if fe.grpc_tls_client_ca and fe.http_port:
            log.warning("gRPC asks clients for certificates ([frontend] grpc_tls_client_ca), but the HTTP port %s "
                        "serves the same models in plaintext without them: set http_port = 0 to serve only "
                        "clients with a certificate (or put a proxy that asks for one in front of it)", fe.http_port)
        watchdog = announce_ready(loop)
        log.info("front door pid %d: gRPC%s %s:%s, HTTP %s:%s, dispatcher %s, cpus %s", os.getpid(),
                 " (TLS, client certificates)" if fe.grpc_tls_client_ca else " (TLS)" if fe.grpc_tls_cert else "",
                 fe.host, fe.grpc_port or "off", fe.host, fe.http_port or "off", node.dispatcher.frontend,
                 sorted(os.sched_getaffinity(0)))
        await stop.wait()
    finally:
        sweeper.cancel()
        if watchdog is not None:
            watchdog.close()
        answer_the_rest = loop.call_later(STOP_GRACE_S - ANSWER_THE_REST_S, core.stop_waiting)
        # Both at once: one after the other took twice the grace.
        await asyncio.gather(*([grpc_server.stop(STOP_GRACE_S)] if grpc_server is not None else []),
                             *([stop_http(http_runner)] if http_runner is not None else []))
        answer_the_rest.cancel()
        client.close()
        core.close()


async def stop_http(runner) -> None:
    """aiohttp's cleanup waits for each request in flight up to the runner's shutdown timeout
    (60 s: one waiting on a long batch held the stop 28 s). After STOP_GRACE_S the connections
    still busy are closed, which cancels their handlers (handler_cancellation) and tells their
    clients; then the cleanup ends at once."""
    cleanup = asyncio.ensure_future(runner.cleanup())
    server = runner.server  # taken before cleanup() drops it
    done, _ = await asyncio.wait({cleanup}, timeout=STOP_GRACE_S)
    if not done:
        busy = list(server.connections) if server is not None else []
        log.warning("closing %d HTTP connections with a request still running after %.0f s", len(busy), STOP_GRACE_S)
        for conn in busy:
            conn.force_close()
        done, _ = await asyncio.wait({cleanup}, timeout=1.0)  # the handlers' cancellation runs
        if not done:
            cleanup.cancel()
            await asyncio.wait({cleanup}, timeout=1.0)
            return
    cleanup.result()


# glibc's malloc: blocks up to this size come from the heap, and the heap's free top goes back to
# the system only past TRIM_THRESHOLD. With glibc's defaults each request's tensor-sized buffers
# (gRPC's message, the answer's bytes) were fresh pages, faulted in and handed back every time:
# 4 MiB in and out cost the front door 10.5-11.3 ms of CPU a request, 4.0 with these (py-spy: brk
# and the copies into new pages). The price: up to TRIM_THRESHOLD of freed memory kept a process.
MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for its sliding threshold
TRIM_THRESHOLD = 128 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h


def keep_freed_memory() -> None:
    """Sets the thresholds above where the C library is glibc; elsewhere leaves them."""
    import ctypes
    import ctypes.util

    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return
    mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)


def run_frontend(node: NodeConfig, source: str = "") -> int:
    """``source``: the config's file, which a config error found here names."""
    from .proctitle import set_title

    set_title("batchyard::frontend")
    keep_freed_memory()
    if node.frontend is None:
        log.error("the config has no [frontend] table: nothing to serve")
        return EX_CONFIG
    from .affinity import pin_node_process

    if pin_node_process(node.frontend.cpus, "frontend", log) is None:  # before gRPC's and ZeroMQ's threads start
        return EX_CONFIG
    import uvloop

    loop = uvloop.new_event_loop()  # grpc.aio and aiohttp both run on it (as the dispatcher does)
    asyncio.set_event_loop(loop)

    async def serve_until_signalled() -> None:
        # The handlers from inside the running loop: uvloop hears a signal only through the
        # self-pipe it sets up while it runs (one added before the run lost a SIGTERM in between).
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # SIGHUP: its registry was left in /dev/shm
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await serve(node, stop)

    try:
        loop.run_until_complete(serve_until_signalled())
    except OSError as e:  # a port taken by something that is not a front door of this node
        from .kserve_tls import TlsFileError

        if isinstance(e, TlsFileError):  # (no restart reads the file better)
            log.error("front door cannot start: %s", f"{source}: {e}" if source else e)
            return EX_CONFIG
        log.error("front door cannot start: %s", e)
        return 1
    finally:
        loop.close()
    return 0
