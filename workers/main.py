"""Worker process entry point: ``batchyard worker --config FILE --name NAME``.

Order matters: bind NUMA memory and pin CPUs, *then* import torch (through the executor),
load and warm every model, and only then register with the dispatcher.
"""

from __future__ import annotations

import logging
import os
import zlib

from batchyard.config import NodeConfig
from batchyard.proctitle import set_title
from batchyard.transport import secure_worker_socket
from batchyard.exit_codes import EX_CONFIG, EX_UNAVAILABLE

log = logging.getLogger("batchyard.worker")


def run_worker(node: NodeConfig, name: str, source: str = "") -> int:
    """``source``: the config's file, which a config error found here names."""
    wcfg = node.worker(name)
    title = "gpu-worker" if wcfg.kind in ("triton", "cuda", "tensorrt") else f"{wcfg.kind}-worker"
    set_title(f"batchyard::{title}[{name}]")
    from batchyard.affinity import pin_cpus

    from .pinning import bind_numa_node, lower_priority

    try:
        # NUMA first: numa_run_on_node sets the thread's mask to the whole node, and bound after
        # pin_cpus it widened the pinning of every thread started later (ZeroMQ's, torch's).
        numa_note = bind_numa_node(wcfg.numa_node)
        cpus = pin_cpus(wcfg.cpus)
    except (ValueError, OSError) as e:  # cpus outside the mask systemd or taskset gave the process
        log.error("[[workers]] %r: %s", name, e)
        return EX_CONFIG
    nice = lower_priority(wcfg.nice)  # before the executor and ZeroMQ start their threads
    log.info("worker %s pid %d: cpus %s; %s; nice %d", name, os.getpid(), cpus, numa_note, nice)
    if wcfg.kind == "vllm":  # an LLM engine serving LlmJobs, not a tensor executor
        from .llm_worker import serve_llm

        return serve_llm(node, wcfg)
    from .runtime import CannotStart, ExecutorUnavailable, WorkerRuntime

    executor = None
    try:
        executor = _make_executor(node, wcfg)
        specs = {}
        for model in wcfg.models:
            mcfg = node.model(model)
            spec = mcfg.spec()
            try:
                executor.load(spec, mcfg.factory)
            except ValueError as e:  # the config's factory: no such function, or one that fails for
                # good (executors.build_model); what may pass (a weights store down) exits 1, restarted
                raise CannotStart(f"[[models]] {model!r}: {e}") from None
            specs[model] = spec
    except CannotStart as e:
        log.error("worker %s cannot start: %s", name, f"{source}: {e}" if source else e)
        if executor is not None and hasattr(executor, "close"):
            executor.close()  # what it registered for models loaded before the failing one
        return EX_CONFIG
    except ExecutorUnavailable as e:  # e.g. Triton not up at start: may come back, so restart us
        log.error("worker %s cannot start: %s", name, e)
        if executor is not None and hasattr(executor, "close"):
            executor.close()
        return EX_UNAVAILABLE
    rt = WorkerRuntime(name, node.dispatcher.backend, executor, specs,
                       heartbeat_interval_s=node.dispatcher.heartbeat_interval_s,
                       max_inflight=wcfg.triton.inflight if wcfg.kind == "triton" else wcfg.max_inflight,
                       numa_node=-1 if wcfg.numa_node is None else wcfg.numa_node,
                       secure=lambda sock: secure_worker_socket(sock, node.dispatcher, node.dispatcher.backend))
    warm = {m: wcfg.warmup_sizes for m in wcfg.models if wcfg.warmup_sizes}
    if wcfg.kind != "sim":  # warm every real path before taking traffic (seed pitfall 2: launch jitter)
        try:
            rt.warmup(warm)
        except CannotStart as e:  # (a bare traceback and exit 1, restarted for ever)
            log.error("worker %s cannot start: %s", name, f"{source}: {e}" if source else e)
            if hasattr(executor, "close"):
                executor.close()
            return EX_CONFIG
        except ExecutorUnavailable as e:  # its backend (Triton) is not up, or not well yet: restarted
            log.error("worker %s cannot start: %s", name, e)
            if hasattr(executor, "close"):
                executor.close()
            return EX_UNAVAILABLE
    return rt.serve()


def _make_executor(node: NodeConfig, wcfg):
    if wcfg.kind == "amx":
        # Single-threaded by default: one pinned single-thread worker per core measured ~25 %
        # more throughput than one multi-threaded worker, and is robust to noisy neighbours.
        os.environ.setdefault("OMP_NUM_THREADS", str(wcfg.threads))
        from .executors import TorchCpuExecutor

        ex = TorchCpuExecutor(threads=wcfg.threads, precision=wcfg.precision)
        log.info("worker %s: model weights in %s (precision = %r)", wcfg.name, ex.precision, wcfg.precision)
        return ex
    if wcfg.kind == "triton":
        from .triton_executor import TritonExecutor

        t = wcfg.triton
        limit = t.max_grpc_message_bytes
        args = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)] if limit else None
        # Stable across restarts of this worker, distinct between nodes sharing one Triton.
        prefix = f"batchyard-{zlib.crc32(node.dispatcher.backend.encode()):08x}-{wcfg.name}-"
        return TritonExecutor(t.url, dict(t.models), inflight=t.inflight, shm=t.shm, device=t.device,
                              region_prefix=prefix, tensor_names={m: dict(r) for m, r in t.tensor_names.items()},
                              channel_args=args, start_timeout_s=t.start_timeout_s)
    if wcfg.kind == "cuda":
        from .cuda_executors import TorchCudaExecutor

        return TorchCudaExecutor(wcfg.cuda.device, wcfg.cuda.precision_for("cuda"), graphs=wcfg.cuda.graphs)
    if wcfg.kind == "tensorrt":
        from .cuda_executors import TensorRTExecutor

        return TensorRTExecutor(dict(wcfg.cuda.onnx), wcfg.cuda.device, fp16=wcfg.cuda.precision_for("tensorrt") == "fp16")
    from .executors import SimulatedExecutor

    return SimulatedExecutor(wcfg.sim, seed=zlib.crc32(wcfg.name.encode()))
