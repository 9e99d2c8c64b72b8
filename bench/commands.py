"""``batchyard bench`` and ``batchyard demo``: registered through the ``batchyard.commands``
entry point. Arguments only; the harness is imported when the command runs."""

from __future__ import annotations

import argparse
import math
from pathlib import Path


def _run_bench(args) -> int:
    from batchyard.cli import exit_on_sigterm

    from .bench_cli import main

    exit_on_sigterm()
    return main(args)


def _run_demo(args) -> int:
    import sys

    from batchyard.cli import exit_on_sigterm

    from .demo import run_demo

    exit_on_sigterm()
    try:
        return run_demo(duration=args.duration, rate=args.rate, policy=args.policy, triton=args.triton)
    except KeyboardInterrupt:  # (a 30-line traceback said no more)
        print("batchyard demo: interrupted", file=sys.stderr)
        return 130


def _numbers(count: int = 0, positive: bool = False, positive_sum: bool = False, most: float = float("inf")):
    """An argparse type: comma-separated non-negative numbers (``count`` of them when given).
    A bad one was a ValueError traceback from inside the harness."""
    def parse(text: str) -> tuple[float, ...]:
        try:
            values = tuple(float(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"not comma-separated numbers: {text!r}") from None
        if any(not v >= 0 or v == float("inf") or (positive and v == 0) for v in values):
            raise argparse.ArgumentTypeError(f"numbers {'>' if positive else '>='} 0 only: {text!r}")
        if count and len(values) != count:
            raise argparse.ArgumentTypeError(f"{count} numbers (high,normal,low), got {text!r}")
        if positive_sum and not sum(values) > 0:
            raise argparse.ArgumentTypeError(f"at least one number > 0: {text!r}")
        if any(v > most for v in values):
            raise argparse.ArgumentTypeError(f"numbers at most {most:g}: {text!r}")
        return values
    return parse


def at_least(low: int):
    """argparse type: an integer of at least ``low``, else a one-line usage error."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = low - 1
        if n < low:
            raise argparse.ArgumentTypeError(f"an integer >= {low}, got {text!r}")
        return n
    return parse


def existing_file(text: str) -> str:
    """argparse type: a path to a readable file, else a one-line usage error (a missing one was
    a FileNotFoundError traceback once the command had started)."""
    try:
        with open(text, "rb"):
            return text
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: {e.strerror}") from None


def number(low: float, above: bool = False, most: float = float("inf")):
    """An argparse type: a finite number >= ``low`` (> with ``above``), at most ``most``. --window -1
    was a traceback from inside the harness; nan and inf passed as well."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = float("nan")
        if not (v > low if above else v >= low) or v == float("inf") or v > most:
            limit = f" and at most {most:g}" if most < float("inf") else ""
            raise argparse.ArgumentTypeError(f"a number {'>' if above else '>='} {low:g}{limit}, got {text!r}")
        return v
    return parse


# A million requests a second: past any node (1e10/s was a MemoryError of 1.6 TiB once the run had
# started; run_load also refuses a run of more than MAX_SCHEDULED requests, rate x duration).
MAX_RATE = 1e6


def _intervals_file(text: str) -> str:
    """--request-intervals: a readable file of intervals, each a finite number of seconds > 0,
    checked before the run. A file of zeros put every request of the run at its first instant
    (17 million at the default duration), and an empty one failed once the generators had started."""
    if not text:  # the default: none
        return text
    try:
        words = Path(text).read_text().split()
    except (OSError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"{text!r}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    if not words:
        raise argparse.ArgumentTypeError(f"{text!r}: no intervals in it (one number of seconds > 0 a line)")
    total = 0.0
    for word in words:
        try:
            v = float(word)
        except ValueError:
            v = float("nan")
        if not (math.isfinite(v) and v > 0):
            raise argparse.ArgumentTypeError(f"{text!r}: intervals are seconds > 0, found {word!r}")
        total += v
    from .harness import MIN_MEAN_INTERVAL_S

    if total / len(words) < MIN_MEAN_INTERVAL_S:  # 1e-9 s made a schedule past memory, mid-run
        raise argparse.ArgumentTypeError(f"{text!r}: intervals {MIN_MEAN_INTERVAL_S:g} s apart on average at least "
                                         f"(a million requests a second), found {total / len(words):g}")
    return text


# --profile KIND:NUMBERS: each kind's numbers, the rule they keep, and both as the help and the
# error say them. step:10 was an IndexError once the run had started, sine:abc a ValueError.
PROFILES = {
    "step": ("R1,R2", lambda a: len(a) == 2 and min(a) >= 0 and max(a) > 0, "rates/s >= 0, one of them > 0"),
    "sine": ("MEAN,AMP,PERIOD", lambda a: len(a) == 3 and a[0] > 0 and a[1] >= 0 and a[2] > 0,
             "MEAN > 0, AMP >= 0, PERIOD > 0 s"),
    "bursts": ("LOW,HIGH", lambda a: len(a) == 2 and min(a) >= 0 and max(a) > 0, "rates/s >= 0, one of them > 0"),
}
PROFILE_FORMS = " | ".join(f"{kind}:{numbers}" for kind, (numbers, _, _) in PROFILES.items())


def _profile(text: str) -> str:
    if not text:  # the default: none
        return text
    from .harness import profile_parts, profile_peak_rate

    kind = text.partition(":")[0]
    if kind not in PROFILES:
        raise argparse.ArgumentTypeError(f"{PROFILE_FORMS}, got {text!r}")
    form, keeps_rule, rule = PROFILES[kind]
    try:
        a = profile_parts(text)[1]
    except ValueError:
        a = []
    if not (all(math.isfinite(v) for v in a) and keeps_rule(a)):
        raise argparse.ArgumentTypeError(f"{kind}:{form} ({rule}), got {text!r}")
    if profile_peak_rate(kind, a) > MAX_RATE:
        raise argparse.ArgumentTypeError(f"{kind}: rates at most {MAX_RATE:g}/s, got {text!r}")
    return text


def _metrics_url(text: str) -> str:
    """--metrics-url: an http(s) address, checked before the run (127.0.0.1:9100/metrics, with no
    scheme, was a urllib traceback after it)."""
    if not text:  # the default: none
        return text
    from urllib.parse import urlsplit

    try:
        url = urlsplit(text)
        url.port  # a port that is no number raises here
    except ValueError:
        url = None
    if url is None or url.scheme not in ("http", "https") or not url.hostname:
        raise argparse.ArgumentTypeError(f"an http:// or https:// address of a /metrics page, got {text!r}")
    return text


def _out_folder(text: str) -> str:
    """--out: a folder bench.json can be written into, checked before the run (a run of many
    minutes ended in a traceback when it could not be written)."""
    from batchyard.cli import output_problem

    why = text and output_problem(text, folder=True)
    if why:
        raise argparse.ArgumentTypeError(f"{text!r}: {why}")
    return text


def policy_name(text: str) -> str:
    """argparse type: a policy the config takes, else a one-line usage error."""
    from batchyard.policy import make_policy

    try:
        make_policy(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", help="dispatcher frontend, e.g. tcp://127.0.0.1:7755")
    p.add_argument("--model", default="minilm")
    p.add_argument("--inputs", default="zeros", choices=["zeros", "minilm"],
                   help="request contents: zeros of the model's spec, or tokenized MiniLM sentences")
    p.add_argument("--target", default="batchyard", choices=["batchyard", "triton"])
    p.add_argument("--triton-url", default="127.0.0.1:8001")
    g = p.add_argument_group("load (as perf_analyzer)")
    g.add_argument("--concurrency", type=at_least(0), default=0, help="closed loop with N requests in flight")
    g.add_argument("--request-rate", type=number(0, most=MAX_RATE), default=0.0)
    g.add_argument("--distribution", default="poisson", choices=["poisson", "constant"])
    g.add_argument("--request-intervals", type=_intervals_file, default="",
                   help="file of inter-request intervals (s, each > 0)")
    g.add_argument("--profile", type=_profile, default="",
                   help=PROFILE_FORMS)
    g.add_argument("--sweep-rates", type=_numbers(positive=True, most=MAX_RATE), default=(), help="comma-separated rates: one run each (p99 vs load)")
    g.add_argument("--priority-mix", type=_numbers(3, positive_sum=True), default=(0.0, 1.0, 0.0),
                   help="fractions high,normal,low (--target triton: sent as Triton's priority 1,2,3)")
    g.add_argument("--deadlines-ms", type=_numbers(3), default=(0.0, 0.0, 0.0),
                   help="per class; 0 = dispatcher default (--target triton: sent as Triton's timeout)")
    g.add_argument("--slo-ms", type=number(0), default=0.0, help="goodput counts only replies within this latency")
    g.add_argument("--processes", type=at_least(1), default=2)
    g.add_argument("--warmup", type=number(0), default=2.0)
    g.add_argument("--window", type=number(0, above=True), default=5.0)
    g.add_argument("--windows", type=at_least(1), default=3)
    g.add_argument("--stability", type=number(0), default=0.15)
    g.add_argument("--seed", type=at_least(0), default=0)
    p.add_argument("--metrics-url", type=_metrics_url, default="", help="the dispatcher's /metrics: adds the server-side queue/compute split (over the whole run: warm-up and drain included)")
    p.add_argument("--compare", action="append", type=policy_name, default=[], metavar="POLICY",
                   help="repeatable: start the node of --config once per policy and replay the same seeded load")
    p.add_argument("--config", default="", help="node config for --compare")
    p.add_argument("--out", type=_out_folder, default="", help="folder for bench.json, bench.md and plots")
    p.add_argument("--measure-ceiling", action="store_true",
                   help="measure this load generator's own ceiling against a no-op worker, then exit")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="perf_analyzer-style load against a dispatcher or a Triton server")
    _bench_arguments(p)
    p.set_defaults(run=_run_bench)
    p = sub.add_parser("demo", help="dispatcher + AMX worker (MiniLM) + simulated GPU, Poisson load, latency table")
    # Checked before the node starts: 0, negative or nan failed after it, in Python's words.
    p.add_argument("--duration", type=number(0, above=True), default=10.0, help="seconds of load")
    p.add_argument("--rate", type=number(0, above=True, most=MAX_RATE), default=60.0,
                   help="mean requests per second (Poisson)")
    p.add_argument("--policy", type=policy_name, default="mcb")
    p.add_argument("--triton", action="store_true", help="GPU worker backed by a real local tritonserver")
    p.set_defaults(run=_run_demo)
