"""Where a request's time goes in Batchyard and in Triton, span by span: both servers as
vs_triton runs them (MiniLM on the server core, the same model code), every request traced by
each server's own trace extension (Triton's ``--trace-config``, Batchyard's ``[frontend]
trace_file``), the same open-loop Poisson load over gRPC from the load core, then the median and
p90 of each span between consecutive timestamps of Triton's trace format.

    python -m batchyard.bench.traced_hops --rate 10 --seconds 40 [--server-cpus 1] [--load-cpu 0] [--out DIR]

Each server gets a few seconds of the load untraced first (oneDNN builds its kernels).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

from .vs_triton import batchyard_server, on_cpus, triton_server

# Triton's timestamps of a gRPC request, in the order they are taken.
SPANS = ("GRPC_WAITREAD_END", "REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_INPUT_END",
         "COMPUTE_OUTPUT_START", "COMPUTE_END", "REQUEST_END", "GRPC_SEND_START", "GRPC_SEND_END")
WARM_UP_S = 5.0


def poisson_load(url: str, model: str, rate: float, seconds: float, seed: int = 1) -> tuple[int, int, list]:
    """Open-loop Poisson gRPC requests of the demo's tokenized sentences: (sent, failed, latencies in s)."""
    import tritonclient.grpc as tg

    from batchyard.workers.models import tokenize

    from .demo import SENTENCES

    ids, mask = tokenize(SENTENCES)
    client = tg.InferenceServerClient(url)
    rng = np.random.default_rng(seed)
    latencies, failed, lock, answered = [], [], threading.Lock(), threading.Semaphore(0)
    sent = 0
    t = time.perf_counter()
    end = t + seconds
    while t < end:
        t += rng.exponential(1 / rate)
        time.sleep(max(0.0, t - time.perf_counter()))  # the schedule's next send (open loop), not a sync
        k = sent % len(SENTENCES)
        a = tg.InferInput("input_ids", [1, ids.shape[1]], "INT64")
        a.set_data_from_numpy(ids[k:k + 1])
        b = tg.InferInput("attention_mask", [1, mask.shape[1]], "INT64")
        b.set_data_from_numpy(mask[k:k + 1])

        def done(result, error, t0=time.perf_counter()):
            with lock:
                (failed if error is not None else latencies).append(time.perf_counter() - t0)
            answered.release()
        client.async_infer(model, [a, b], done)
        sent += 1
    for _ in range(sent):
        answered.acquire()
    client.close()
    return sent, len(failed), latencies


def spans(path: Path) -> np.ndarray:
    """[trace, span] µs between consecutive SPANS timestamps, then the whole, of every trace that has them all."""
    by_id: dict = {}
    for record in json.loads(path.read_text()):
        for ts in record.get("timestamps", ()):
            by_id.setdefault(record["id"], {})[ts["name"]] = ts["ns"]
    rows = [[t[b] - t[a] for a, b in zip(SPANS, SPANS[1:])] + [t[SPANS[-1]] - t[SPANS[0]]]
            for t in by_id.values() if all(k in t for k in SPANS)]
    return np.array(rows, dtype=float).reshape(-1, len(SPANS)) / 1e3


def traced_run(server_cm, url_of, rate: float, seconds: float, trace_file: Path, load_cpu: int) -> dict:
    import tritonclient.grpc as tg

    trace_file.unlink(missing_ok=True)
    with server_cm as got:
        server = got[0] if isinstance(got, tuple) else got
        url, model = url_of(server)
        with on_cpus({load_cpu}):
            poisson_load(url, model, rate, WARM_UP_S)
            control = tg.InferenceServerClient(url)
            control.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1"})
            sent, failed, latencies = poisson_load(url, model, rate, seconds)
            control.update_trace_settings(settings={"trace_level": ["OFF"]})  # (Triton writes its traces now)
            control.close()
    ms = np.asarray(latencies) * 1e3
    return {"sent": sent, "failed": failed, "p50_ms": float(np.percentile(ms, 50)) if len(ms) else float("nan"),
            "p99_ms": float(np.percentile(ms, 99)) if len(ms) else float("nan"), "spans_us": spans(trace_file)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m batchyard.bench.traced_hops", description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, default=10.0, help="offered Poisson load, req/s")
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--server-cpus", default="1")
    ap.add_argument("--load-cpu", type=int, default=0)
    ap.add_argument("--out", default="bench/results/traced_hops")
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cpus = [int(c) for c in a.server_cpus.split(",")]
    runs = {
        "batchyard": traced_run(batchyard_server(cpus, trace_file=str(out / "batchyard_trace.json")),
                                lambda s: (s.url, s.model), a.rate, a.seconds, out / "batchyard_trace.json", a.load_cpu),
        "triton 0 us": traced_run(triton_server(0, cpus, trace_file=str(out / "triton_trace.json")),
                                  lambda s: (s.url, s.model), a.rate, a.seconds, out / "triton_trace.json", a.load_cpu),
    }
    names = [f"{x} → {y}" for x, y in zip(SPANS, SPANS[1:])] + ["whole (handler start → sent)"]
    rows = []
    for i, name in enumerate(names):
        row = [name.replace("_", "\\_")]
        for r in runs.values():
            col = r["spans_us"][:, i]
            row.append(f"{np.median(col):.0f} ({np.percentile(col, 90):.0f})" if len(col) else "—")
        rows.append(row)
    command = "python -m batchyard.bench.traced_hops " + " ".join(argv if argv is not None else sys.argv[1:])
    text = "\n".join([
        f"# Where a request's time goes: Batchyard's front door and Triton 2.51, MiniLM on cpu {a.server_cpus}, "
        f"{a.rate:g} req/s Poisson from cpu {a.load_cpu}", "", f"Command: `{command.strip()}`", "",
        *(f"- {k}: {r['sent']} requests, {r['failed']} failed, {len(r['spans_us'])} traced whole; client-observed "
          f"p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms" for k, r in runs.items()), "",
        "Median (p90) µs of each span between consecutive timestamps of Triton's trace format (each server's own "
        "trace extension; docs/frontend.md, \"Traces\", says what Batchyard's mean):", "",
        f"| span | {' | '.join(runs)} |", "|---" * (len(runs) + 1) + "|",
        *(f"| {' | '.join(row)} |" for row in rows)])
    (out / "report.md").write_text(text + "\n")
    with contextlib.suppress(OSError):
        for k in ("batchyard_trace.json", "triton_trace.json"):
            (out / k).unlink()  # the report keeps what they said
    print(text)


if __name__ == "__main__":
    main()
