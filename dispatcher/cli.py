"""The ``batchyard`` command.

The core commands (``dispatcher``, ``up``, ``status``) live here. Commands that belong to the
worker and bench packages are plug-ins registered through the ``batchyard.commands`` entry-point
group, so imports run one way (bench -> workers -> core): this module never names them. Each
plug-in's ``register`` only adds arguments; the module that does the work is imported after the
command line is parsed, so a dispatcher process never imports torch or the bench harness.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import logging
import os
import re
import sys
from importlib.metadata import entry_points

from .config import ConfigError, config_source, load_config
from .exit_codes import EX_CONFIG


def exit_on_sigterm() -> None:
    """A SIGTERM (timeout, systemd, kill) unwinds through the command's clean-up, as Ctrl-C does.
    Without it, it ended the command at once: the demo's node processes were orphaned and its
    temporary folders left behind, the bench's load generators went on loading the node until
    the run would have ended, and calibrate left its worker's folder and socket file."""
    import signal

    def stop(signo, _frame):
        raise SystemExit(128 + signo)

    signal.signal(signal.SIGTERM, stop)


def load_node(path: str, workers: tuple[str, ...] | None = (), control: bool = False, binds: bool = True):
    """The node config at ``path``, checked against this host for the named ``workers`` (None:
    every worker; the processes that start them) and, with ``control``, for the dispatcher and
    front door, or exit 78 (EX_CONFIG: neither `up` nor systemd restarts it) with the validation
    message."""
    try:
        cfg = load_config(path)
        if workers != () or control:
            try:
                cfg.check_host(workers, control, binds)
            except ConfigError as e:
                raise ConfigError(f"{config_source(path)}: {e}") from None
        return cfg
    except ConfigError as e:
        print(f"batchyard: {e}", file=sys.stderr)
        raise SystemExit(EX_CONFIG)


def output_problem(path: str, folder: bool = False) -> str | None:
    """Why a file (with ``folder``, a folder, made with its parents) cannot be written at
    ``path``, or None. Asked before the work whose result goes there: `calibrate` measured
    every worker, and `bench` ran its whole load, before failing to write it with a traceback.
    It tries: permission bits do not say (root passes them on /proc, where nothing is made)."""
    import tempfile
    from pathlib import Path

    target = Path(path)
    if target.exists() and target.is_dir() != folder:
        return "is not a folder" if folder else "is a folder"
    if folder:  # made with its parents: the nearest folder that exists must take one
        where = target
        while not where.exists() and where != where.parent:
            where = where.parent
        if not where.is_dir():
            return f"{str(where)!r} is not a folder"
    else:
        where = target.parent
        if not where.is_dir():
            return f"no folder {str(where)!r}"
    try:
        if not folder and target.exists():
            open(target, "ab").close()  # appends nothing: the file stays as it is
        else:
            os.rmdir(tempfile.mkdtemp(prefix=".batchyard-probe-", dir=where))
    except OSError as e:
        # A file there that may not be written is named, not its folder (one anyone may write in).
        what = f"cannot write to {str(target)!r}" if not folder and target.exists() else f"cannot write in {str(where)!r}"
        return f"{what}: {e.strerror or e}"
    return None


def _run_dispatcher(args) -> int:
    from .dispatcher_main import run_dispatcher

    return run_dispatcher(load_node(args.config, control=True))


def _run_frontend(args) -> int:
    from .frontend_main import run_frontend

    node = load_node(args.config, control=True, binds=False)  # the front door binds only its own ports
    if node.frontend is None:  # (a log line that named no file)
        print(f"batchyard: {args.config}: no [frontend] table: nothing for `batchyard frontend` to serve",
              file=sys.stderr)
        raise SystemExit(EX_CONFIG)
    return run_frontend(node, config_source(args.config))


def _run_up(args) -> int:
    from .supervisor import run_up

    return run_up(args.config, load_node(args.config, workers=None, control=True), args.log_level.upper())


def _run_status(args) -> int:
    import json

    import msgspec

    from .client import Client
    from .errors import BatchyardError, InvalidArgument
    from .exit_codes import EX_UNAVAILABLE, EX_USAGE

    address, keys = args.address, {}
    if args.config:  # the node's own frontend and key pair: a CURVE endpoint admits it
        from .transport import node_client_keys

        node = load_node(args.config)
        address = node.dispatcher.frontend
        keys = node_client_keys(node.dispatcher, address)
    try:
        with Client(address, **keys) as c:
            print(json.dumps(msgspec.to_builtins(c.status(timeout=5.0)), indent=1))
    except BatchyardError as e:  # a malformed address, or no dispatcher there: one line, not a traceback
        print(f"batchyard: {e}", file=sys.stderr)
        return EX_USAGE if isinstance(e, InvalidArgument) else EX_UNAVAILABLE
    return 0


def _run_keygen(args) -> int:
    from .transport import write_keypair

    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", args.name):
        print(f"batchyard keygen: --name {args.name!r}: letters, digits, '_', '.' and '-' only", file=sys.stderr)
        return 64
    secret_file = os.path.join(args.out, f"{args.name}.key_secret")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        print(f"batchyard keygen: --out {args.out!r} is not a folder", file=sys.stderr)
        return 64
    why = output_problem(args.out, folder=True)
    if why:  # (/proc/x was FileNotFoundError's traceback)
        print(f"batchyard keygen: --out {args.out!r}: {why}", file=sys.stderr)
        return 73  # EX_CANTCREAT
    # Replaced, the node's secret key was gone for good, and every client that trusted its public
    # key was locked out; a public key of that name (a client's, in the authorized folder) was
    # written over, and a symlink under either name was followed.
    there = [f for f in (secret_file, secret_file[:-len("_secret")]) if os.path.lexists(f)]
    if there and not args.force:
        print(f"batchyard keygen: {there[0]} exists; --force replaces it", file=sys.stderr)
        return 73  # EX_CANTCREAT
    try:
        public, secret = write_keypair(args.out, args.name, replace=args.force)
    except FileExistsError as e:  # made since the check
        print(f"batchyard keygen: {e.filename2 or e.filename} exists; --force replaces it", file=sys.stderr)
        return 73
    except OSError as e:  # the folder changed since the check (or refused the key files themselves)
        print(f"batchyard keygen: --out {args.out!r}: {e.strerror or e}", file=sys.stderr)
        return 73
    print(f"public key (share it; put clients' in [dispatcher] curve_authorized_keys): {public}")
    print(f"secret key (keep it; mode 0600): {secret}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="batchyard", description="Batchyard inference dispatcher")
    ap.add_argument("--log-level", default="INFO", type=str.upper,
                    choices=["CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG"])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("dispatcher", help="run the dispatcher process of a node")
    p.add_argument("--config", required=True)
    p.set_defaults(run=_run_dispatcher)
    p = sub.add_parser("frontend", help="run a KServe v2 (Triton protocol) front-door process of a node")
    p.add_argument("--config", required=True)
    p.set_defaults(run=_run_frontend)
    p = sub.add_parser("up", help="start a node's dispatcher and workers; restart workers that die")
    p.add_argument("--config", required=True)
    p.set_defaults(run=_run_up)
    p = sub.add_parser("status", help="a running dispatcher's workers, learned cost curves, lambda and decisions")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--address", help="the dispatcher's frontend, e.g. tcp://127.0.0.1:7755")
    where.add_argument("--config", help="the node's config: its frontend, with the node's CURVE key if it has one")
    p.set_defaults(run=_run_status)
    p = sub.add_parser("keygen", help="a CURVE key pair for tcp endpoints: NAME.key (public), NAME.key_secret")
    p.add_argument("--out", required=True, help="folder to write the two files into")
    p.add_argument("--name", required=True, help="e.g. the node or the client's name")
    p.add_argument("--force", action="store_true", help="replace an existing key pair of that name")
    p.set_defaults(run=_run_keygen)
    for ep in sorted(entry_points(group="batchyard.commands"), key=lambda e: e.name):
        ep.load()(sub)
    return ap


# The open-file limit every command raises its soft limit to (or the hard limit, if lower), as
# the systemd units' LimitNOFILE does.
FD_LIMIT = 65536


def raise_fd_limit() -> None:
    """The soft limit on open files up to FD_LIMIT, where the hard limit allows: each local
    client connection takes a descriptor of the dispatcher, and libzmq aborts the process when
    accept() on an ipc socket finds none (an assertion, not an error): at a shell's soft 1,024
    (256 tried), a few hundred idle clients stopped the node."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = FD_LIMIT if hard == resource.RLIM_INFINITY else min(hard, FD_LIMIT)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    raise_fd_limit()
    # Every thread's Python stack to stderr on SIGABRT (what `up` and systemd's watchdog send a
    # hung process) and on a crash: the log says where it hung, not only that it did. (Left as
    # it is where the caller has it on already, as pytest does around an in-process call.)
    if not faulthandler.is_enabled():
        faulthandler.enable()
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    return args.run(args)


def run_and_exit() -> None:
    """The program (``batchyard``, ``python -m batchyard.cli``): ``main()``, then the exit
    without the interpreter's last garbage collections over every object the process made.
    Those collections are most of a process's exit, and the command has closed what it
    opened by then: a front door took 0.25-0.39 s from its last statement to its end, 45 ms
    with ``gc.freeze()``; a process with torch imported (a model's worker) 0.88-1.17 s, 0.24 s;
    the dispatcher and `up` 0.06-0.15 s, 0.02 s. A node stops its processes one after the
    other, so each stop of a node paid it three times or more. ``atexit`` handlers (logging's
    flush, ``weakref.finalize``) still run, and objects freed by their reference counts still
    are; only what sits in a reference cycle is left to the exit to reclaim."""
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    run_and_exit()
