"""``batchyard bench``: runs the harness (bench/harness.py) as the command line asked; the
arguments are declared in bench/commands.py."""

from __future__ import annotations

import contextlib
import signal
import sys
from pathlib import Path

from .harness import LoadSpec, analyse, run_load, scrape, server_split
from .report import status_name, table, unavailable_of_sent, write_outputs

# The load modes, one a run: (flag, argument). The harness lets the closed loop win over the
# rest, and a file of intervals or a profile over a rate, so a second mode was dropped unsaid and
# the runs labelled with a rate never offered ("@10/s" on a closed loop of 640/s).
# --distribution, the mixes, the SLO and --compare go with any of them.
LOAD_MODES = (("--concurrency", "concurrency"), ("--request-rate", "request_rate"), ("--sweep-rates", "sweep_rates"),
              ("--request-intervals", "request_intervals"), ("--profile", "profile"))


def _targets(args, address):
    """(policy label, address, client keys) triples: the given address, or one fresh node per
    --compare policy, reached with the node's own key pair (a CURVE endpoint admits it: without
    it the bench started the node and then could not reach it)."""
    if not args.compare:
        yield "", address, {}
        return
    import msgspec

    from batchyard.config import ConfigError, load_config
    from batchyard.exit_codes import EX_CONFIG
    from batchyard.supervisor import NodeNotReady, running_node
    from batchyard.transport import node_client_keys

    if not args.config:
        raise SystemExit("bench: --compare needs --config (the node to start once per policy)")
    try:
        base = load_config(args.config)
        try:  # what the node needs of this host, as `up` checks it before it starts anything
            base.check_host(control=True)
        except ConfigError as e:
            raise ConfigError(f"{args.config}: {e}") from None
    except ConfigError as e:  # one line and 78, as every command's (it was a traceback, or exit 1)
        print(f"bench: {e}", file=sys.stderr)
        raise SystemExit(EX_CONFIG) from None
    for policy in args.compare:
        disp = msgspec.structs.replace(base.dispatcher, policy=policy)
        # The whole node but its policy (a copy of three of its tables dropped [frontend] and
        # [[llm_models]]).
        with contextlib.ExitStack() as node:
            try:
                node.enter_context(running_node(msgspec.structs.replace(base, dispatcher=disp).validate()))
            except NodeNotReady as e:  # a worker that cannot start (its model's factory, say): one line
                print(f"bench: the node of {args.config} did not start: {e}", file=sys.stderr)
                raise SystemExit(e.exit_code) from None
            yield policy, disp.frontend, node_client_keys(disp, disp.frontend)


def sends_schedule_policy(args) -> bool:
    """Whether --target triton sends each request's class and deadline to the server, as Triton's
    schedule-policy ``priority`` (class + 1) and ``timeout`` parameters: whenever the mix holds a
    class other than normal or a deadline is given. Without them the report showed classes and
    deadlines the server never saw (every request at its default priority, every deadline only
    the client's). Triton takes both from any model: one without ``priority_levels`` runs a
    priority out of its range at its default level rather than refusing the request."""
    mix, deadlines = args.priority_mix, args.deadlines_ms
    return args.target == "triton" and bool(mix[0] or mix[2] or any(deadlines))


def spec_from(args, rate: float = 0.0) -> LoadSpec:
    # Stable over 3 windows (LoadSpec's), or over both of 2: they had no 3 windows to agree
    # and reported every run unstable. One window is not judged (harness.analyse).
    return LoadSpec(concurrency=args.concurrency, rate=rate or args.request_rate, distribution=args.distribution,
                    intervals_file=args.request_intervals, profile=args.profile,
                    priority_mix=args.priority_mix, deadlines_ms=args.deadlines_ms, slo_ms=args.slo_ms,
                    warmup_s=args.warmup, window_s=args.window, windows=args.windows, stability=args.stability,
                    stable_windows=min(LoadSpec.stable_windows, args.windows), processes=args.processes,
                    seed=args.seed, schedule_policy=sends_schedule_policy(args))


def load_modes(args) -> list[str]:
    """The load-mode flags given (LOAD_MODES), in their declared order."""
    return [flag for flag, dest in LOAD_MODES if getattr(args, dest)]


def refuse_mixed_load_modes(args) -> None:
    """Exit 2 with argparse's one line when more than one load mode is given."""
    given = load_modes(args)
    if len(given) > 1:
        print(f"batchyard bench: error: argument {given[1]}: not allowed with argument {given[0]}", file=sys.stderr)
        raise SystemExit(2)
    # Constant spacing is an open loop's at one rate; beside the other modes it was ignored unsaid.
    unspaced = [flag for flag in given if flag not in ("--request-rate", "--sweep-rates")]
    if args.distribution == "constant" and unspaced:
        print(f"batchyard bench: error: argument --distribution: constant is not allowed with argument {unspaced[0]} "
              f"(it spaces --request-rate and --sweep-rates)", file=sys.stderr)
        raise SystemExit(2)


def run_label(name: str, model: str, spec: LoadSpec) -> str:
    """A run's label, from the load it ran: a rate only for an open loop at that rate."""
    if spec.rate and not (spec.concurrency or spec.intervals_file or spec.profile):
        return f"{name}:{model} @{spec.rate:g}/s"
    return f"{name}:{model}"


def scrape_metrics(url: str) -> list:
    """The samples at --metrics-url, or a one-line error (it was urllib's traceback)."""
    from urllib.error import HTTPError

    try:
        return scrape(url)
    except (OSError, ValueError) as e:  # refused, unreachable, timed out, an HTTP error, no exposition
        why = e if isinstance(e, HTTPError) else getattr(e, "reason", e)
        raise SystemExit(f"bench: cannot read --metrics-url {url}: {why}") from None


def node_answers(address: str, keys: dict, target: str = "batchyard") -> bool:
    """Whether the node at ``address`` still answers (3 s): a Batchyard node's status request,
    or a Triton server's (or front door's) gRPC ServerLive."""
    if target == "triton":
        import tritonclient.grpc as tc
        from tritonclient.utils import InferenceServerException

        try:
            with tc.InferenceServerClient(address) as c:
                return bool(c.is_server_live(client_timeout=3.0))
        except InferenceServerException:
            return False
    from batchyard.client import Client
    from batchyard.errors import BatchyardError

    try:
        with Client(address, **keys) as c:
            c.status(timeout=3.0, brief=True)
        return True
    except BatchyardError:
        return False


def measure_ceiling(processes: int, concurrency: int = 256, window: float = 5.0) -> float:
    from .noop_paths import NodeRun

    with NodeRun() as r:
        spec = LoadSpec(concurrency=concurrency, warmup_s=1.0, window_s=window, windows=1, processes=processes,
                        stable_windows=1)
        rep = analyse(run_load(r.address, "noop", spec), spec, "batchyard", "no-op ceiling")
    return rep.summary["throughput_rps"]


def main(args) -> int:
    refuse_mixed_load_modes(args)
    if args.measure_ceiling:
        rps = measure_ceiling(args.processes)
        print(f"load generator ceiling: {rps:,.0f} requests/s ({args.processes} processes, closed loop, "
              f"256 in flight, no-op worker behind a dispatcher on this machine)")
        return 0
    if args.compare and args.target == "triton":
        # (it started the node, then gave its ZeroMQ address to the gRPC client: "Misformatted
        # domain name")
        raise SystemExit("bench: --compare measures the nodes it starts through Batchyard's own protocol: "
                         "not with --target triton")
    address = args.triton_url if args.target == "triton" else args.address
    if not address and not args.compare:
        raise SystemExit("bench: give --address, --compare with --config, or --target triton --triton-url")
    rates = list(args.sweep_rates) or [args.request_rate]
    if not args.concurrency and not any(rates) and not args.request_intervals and not args.profile:
        raise SystemExit("bench: choose a load: --concurrency, --request-rate, --sweep-rates, "
                         "--request-intervals or --profile")
    reports, gone = [], []
    try:
        _run_all(args, address, rates, reports, gone)
    except (KeyboardInterrupt, SystemExit) as e:
        # Ctrl-C, or SIGTERM (cli.exit_on_sigterm's SystemExit): one line, and the loads measured
        # whole written (a traceback said it, and a sweep's finished rates were lost). So are they
        # where the harness failed a later load (a node gone, unreachable at the next rate: the
        # loads before it were lost).
        code = 130 if isinstance(e, KeyboardInterrupt) else e.code
        interrupted = not isinstance(e, SystemExit) or code == 128 + signal.SIGTERM
        if interrupted:
            # (a load cut short is not written: its replies are still in its generators)
            print(f"\nbatchyard bench: interrupted{'' if reports else ' before a load was measured whole'}",
                  file=sys.stderr)
        if reports and args.out:
            why = "interrupted" if interrupted else "ended by an error"
            write_outputs(reports, Path(args.out), f"batchyard bench: {args.target} {args.model} ({why})")
            print(f"(the {len(reports)} loads measured whole written to {Path(args.out)}/)", file=sys.stderr)
        if not interrupted:
            raise  # the harness's own words for the failure
        return code
    print()
    print(table(reports))
    if args.out:
        write_outputs(reports, Path(args.out), f"batchyard bench: {args.target} {args.model}")
        print(f"(written to {Path(args.out)}/)")
    lost = sum(unavailable_of_sent(r) for r in reports)
    if lost:  # the node went away or could not be reached mid-run: the numbers do not measure it (it exited 0)
        print(f"bench: {lost} requests sent in the measured windows failed UNAVAILABLE (the node went away or "
              "could not be reached): the run does not measure it", file=sys.stderr)
    if gone:
        print(f"bench: the node stopped answering during {', '.join(gone)} (it went away): the run does not "
              "measure it", file=sys.stderr)
    failed = [r for r in reports if r.summary.get("requests") and not r.summary.get("served")]
    for r in failed:  # (it exited 0, "errors 35" its only sign)
        statuses = ", ".join(f"{status_name(int(k))} {n}" for k, n in r.summary["errors"].items())
        print(f"bench: every request of {r.label} failed ({statuses}): the run measures nothing", file=sys.stderr)
    return 1 if lost or gone or failed else 0


def _run_all(args, address: str, rates: list, reports: list, gone: list) -> None:
    """Every load of the run, one after the other, each's report appended to ``reports`` once
    measured whole (and its label to ``gone`` where the node stopped answering after it)."""
    for policy, address, keys in _targets(args, address):
        for rate in rates:
            spec = spec_from(args, rate)
            name = f"{args.target}[{policy}]" if policy else args.target
            label = run_label(name, args.model, spec)
            before = scrape_metrics(args.metrics_url) if args.metrics_url else None
            rows = run_load(address, args.model, spec, target=args.target, inputs=args.inputs, progress=True,
                            keys=keys)
            rep = analyse(rows, spec, args.target, label)
            if before is not None:
                try:
                    rep.summary["server_split"] = server_split(before, scrape_metrics(args.metrics_url))
                except SystemExit as e:  # (a node gone: the run was lost, and the error blamed the URL)
                    print(f"{e.code}: {label} is written without its server split", file=sys.stderr)
            reports.append(rep)
            print(table(reports[-1:]), flush=True)
            # Requests sent after a node died wait in the client and fail DEADLINE_EXCEEDED, only
            # those running then UNAVAILABLE: a node killed between requests, or in the warm-up,
            # left no UNAVAILABLE behind, and the run exited 0 with nothing measured.
            if not node_answers(address, keys, args.target):
                gone.append(label)
                return  # (the next load's start found no node, and its error lost these)
