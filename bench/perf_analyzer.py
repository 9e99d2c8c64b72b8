"""Triton's perf_analyzer, as shipped in the tritonclient wheel, made runnable from the virtualenv.

``python -m batchyard.bench.perf_analyzer -m <model> -u 127.0.0.1:8001 -i grpc ...`` runs it with
the arguments given (any of perf_analyzer's own), against Batchyard's front door or a Triton;
``python -m batchyard.bench.perf_analyzer --write-minilm-data FILE`` writes the demo model's inputs
(tokenized sentences) for ``--input-data FILE`` (random int64 token ids would index outside the
embedding table).

The binary (``.venv/bin/perf_analyzer``) links two libraries the wheel does not carry:
``libcudart.so.12`` (from the ``nvidia-cuda-runtime-cu12`` wheel, a dependency of the ``bench``
extra; it loads without a GPU, and only ``--shared-memory cuda`` would call it) and libb64's
``libb64.so.0d`` (a Debian package, not on PyPI): the latter is compiled from ``libb64.c`` beside
this file into ``<venv>/lib/batchyard-perf-analyzer/`` with the system C compiler, once.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("libb64.c")


class PerfAnalyzerMissing(RuntimeError):
    pass


def _binary() -> Path:
    exe = Path(sys.executable).parent / "perf_analyzer"
    if not exe.exists():
        raise PerfAnalyzerMissing(f"{exe} not found: it comes with tritonclient (the project's triton extra)")
    return exe


def _cudart_dir() -> Path:
    spec = importlib.util.find_spec("nvidia.cuda_runtime")
    if spec is None or not spec.submodule_search_locations:
        raise PerfAnalyzerMissing("nvidia-cuda-runtime-cu12 is not installed (the project's bench extra)")
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib"
    if not (lib / "libcudart.so.12").exists():
        raise PerfAnalyzerMissing(f"{lib}/libcudart.so.12 not found")
    return lib


def _libb64_dir() -> Path:
    out = Path(sys.prefix) / "lib" / "batchyard-perf-analyzer"
    lib = out / "libb64.so.0d"
    if lib.exists() and lib.stat().st_mtime >= SOURCE.stat().st_mtime:
        return out
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise PerfAnalyzerMissing("no C compiler (cc/gcc) to build libb64.so.0d for perf_analyzer")
    tmp = out / f".libb64.{os.getpid()}.so"
    try:
        out.mkdir(parents=True, exist_ok=True)
        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(SOURCE)], check=True,
                       capture_output=True, text=True)
        os.replace(tmp, lib)  # atomic: concurrent first uses each build, the last rename wins
    except (OSError, subprocess.CalledProcessError) as e:
        tmp.unlink(missing_ok=True)
        detail = getattr(e, "stderr", "") or str(e)
        raise PerfAnalyzerMissing(f"could not build {lib} with {cc}: {detail.strip()[-500:]}") from None
    return out


def command(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that run perf_analyzer with ``args``."""
    exe = _binary()
    libs = [str(_libb64_dir()), str(_cudart_dir())]
    old = os.environ.get("LD_LIBRARY_PATH")
    env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(libs + ([old] if old else [])))
    return [str(exe), *args], env


# ---------------------------------------------------------------- one open-loop Poisson run
PASS = re.compile(r"Pass \[\d+\] throughput: ([\d.]+) infer/sec\. p99 latency: (\d+) usec")
# "Perf Analyzer was not able to keep up with the desired request rate. 6.05% of the requests were delayed."
BEHIND = re.compile(r"not able to keep up with the desired request rate\.\s*([\d.]+)% of the requests were delayed")


def minilm_input_data(path: Path) -> Path:
    """perf_analyzer's --input-data file: the demo's tokenized sentences, one request each, in
    turn (random int64 token ids would index outside the embedding table)."""
    from batchyard.workers.models import tokenize

    from .demo import SENTENCES

    ids, mask = tokenize(SENTENCES)
    data = [{"input_ids": {"content": i.tolist(), "shape": [len(i)]},
             "attention_mask": {"content": m.tolist(), "shape": [len(m)]}} for i, m in zip(ids, mask)]
    path.write_text(json.dumps({"data": data}))
    return path


def run_rate(url: str, model: str, rate: float, *, window_s: float, trials: int, stability: float,
             input_data: Path | None = None, protocol: str = "grpc") -> dict:
    """perf_analyzer at ``rate`` req/s, Poisson, async, over ``protocol`` (grpc or http): it
    measures windows of ``window_s`` until the last 3 agree within ``stability`` (p99 and
    throughput) or ``trials`` run out, and reports the 3 merged. Unstable runs are kept too
    (perf_analyzer writes no result for them): throughput = mean of the last 3 windows, p99 =
    their largest, p50 unknown."""
    with tempfile.TemporaryDirectory(prefix="by-pa-") as d:
        out = Path(d) / "result.csv"
        args = ["-m", model, "-u", url, "-i", protocol, "--async", "--request-rate-range", f"{rate:g}",
                "--request-distribution", "poisson", "--measurement-interval", str(int(window_s * 1000)),
                "--max-trials", str(trials), "-s", f"{stability * 100:g}", "--percentile", "99", "-v",
                "-f", str(out)] + (["--input-data", str(input_data)] if input_data else [])
        cmd, env = command(args)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True,
                           timeout=(trials + 3) * window_s * 3 + 120)
        row = None
        if out.exists():
            with out.open() as f:
                row = next(csv.DictReader(f), None)
    passes = [(float(t), int(p) / 1e3) for t, p in PASS.findall(r.stdout)]
    if r.returncode not in (0, 2) or not passes:  # 2: no stable measurement within the trials
        raise RuntimeError(f"perf_analyzer exited {r.returncode}: {(r.stdout + r.stderr)[-1500:]}")
    nan = float("nan")
    if row is not None:
        ms = lambda k: float(row[k]) / 1e3  # noqa: E731 -- the CSV is in microseconds
        summary = {"throughput_rps": float(row["Inferences/Second"]), "p50_ms": ms("p50 latency"),
                   "p90_ms": ms("p90 latency"), "p99_ms": ms("p99 latency")}
    else:
        last = passes[-3:]
        summary = {"throughput_rps": sum(t for t, _ in last) / len(last), "p50_ms": nan, "p90_ms": nan,
                   "p99_ms": max(p for _, p in last)}
    failed = re.findall(r"had error:?\s*(.*)", r.stdout + r.stderr)
    summary.update(p999_ms=nan, goodput_rps=nan, errors={"perf_analyzer": len(failed)} if failed else {})
    if failed:  # the server's own words (status and message), so a failed request can be explained later
        summary["error_messages"] = sorted({m.strip()[:300] for m in failed})[:5]
    # perf_analyzer's own word that its schedule slipped (the harness's is its send lag): the
    # offered load was not the one asked for, and the report must say so.
    behind = BEHIND.search(r.stdout + r.stderr)
    if behind:
        summary["delayed_share"] = float(behind.group(1)) / 100
    return {"summary": summary, "stable": row is not None, "passes": passes, "schedule_kept": behind is None}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--write-minilm-data"] and len(args) == 2:  # the demo model's inputs, for --input-data
        try:
            print(minilm_input_data(Path(args[1])))
        except OSError as e:  # (a missing folder was a traceback)
            print(f"perf_analyzer: cannot write {args[1]}: {e.strerror}", file=sys.stderr)
            return 1
        return 0
    try:
        cmd, env = command(args)
    except PerfAnalyzerMissing as e:
        print(f"perf_analyzer: {e}", file=sys.stderr)
        return 69  # EX_UNAVAILABLE
    return subprocess.run(cmd, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
