"""A real Triton Inference Server on this host, from the ``nvidia-pytriton`` wheel.

The wheel ships ``tritonserver`` (2.51) and the python backend. Started standalone it needs:
- a backend folder assembled from the wheel's ``libtriton_python.so``,
  ``triton_python_backend_utils.py`` and the stub built for *this* Python;
- ``LD_LIBRARY_PATH`` with the running interpreter's libpython and the wheel's
  ``nvidia_pytriton.libs`` (without them the stub cannot start and model load hangs instead
  of failing, hence the readiness deadline);
- our virtualenv's site-packages on the stub's ``PYTHONPATH`` (models import numpy/torch).
Process ownership (``batchyard triton-local`` runs it as a service):
- the server runs in its own process group (its python-backend stubs inherit it) and gets
  SIGTERM when the process that started it dies, however it dies (PR_SET_PDEATHSIG);
- ``stop()`` terminates the server gently, then SIGKILLs whatever is left of its group (a
  crashed server's stubs) while the server is still an unreaped zombie, so the group id cannot
  have been reused, and removes the ``/dev/shm`` regions of *this* server only: their names carry
  a per-instance prefix (the python backend's ``shm-region-prefix-name``);
- ``serve()`` runs until SIGTERM/SIGINT (also during start-up) or until the server exits by itself,
  then returns its exit status. It makes its process a child subreaper, so that the stubs of a
  server that crashed are reparented to it rather than to pid 1, and reaps them.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from batchyard.addresses import free_port as _free_port
from batchyard.private_tmp import PrivateDir

from .triton_regions import cuda_device_count

log = logging.getLogger("batchyard.triton")
_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36
EXIT_TIMEOUT_S = 10  # tritonserver's own grace period on SIGTERM; stop() waits longer than this


class ServerExited(RuntimeError):
    def __init__(self, returncode: int, message: str):
        super().__init__(message)
        self.returncode = returncode


class _StopRequested(BaseException):
    """SIGTERM/SIGINT in serve(): unwinds whatever it interrupts (start-up included) to the cleanup."""


def exit_status(returncode: int) -> int:
    """A child's Popen returncode as a shell would report it (-N: killed by signal N -> 128+N)."""
    return 128 - returncode if returncode < 0 else returncode


def die_with_parent(parent: int) -> None:
    """Runs in a child between fork and exec (``preexec_fn``): SIGTERM when ``parent`` dies,
    however it dies, and an unblocked signal mask."""
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    if os.getppid() != parent:  # we died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def default_stub_site() -> str:
    """A folder holding numpy<2 for the python-backend stub.

    The wheel's stub embeds Python in isolated mode (it ignores PYTHONPATH; sys.path[0] is its
    working directory) and was built against numpy 1.x: with numpy 2 its outputs came back
    empty, silently. So the server runs with this folder as its working directory.
    """
    site = Path(sys.prefix) / "triton-stub-site"
    if not (site / "numpy").is_dir():
        raise RuntimeError(f"the Triton python-backend stub needs numpy<2 in {site}: run "
                           f"`{sys.executable} -m pip install --target {site} 'numpy<2'` (make test does)")
    return str(site)


def pytriton_root() -> Path:
    """The wheel's ``tritonserver`` folder, found without importing pytriton: its import pulls in
    its own client and model stack (0.4 s here) and wants numpy<2."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("nvidia-pytriton is not installed: pip install 'batchyard[triton]'")
    return Path(next(iter(spec.submodule_search_locations))) / "tritonserver"


class TritonLocal:
    def __init__(self, model_repository: str | Path, grpc_port: int = 0, http_port: int = 0,
                 metrics_port: int = 0, log_verbose: int = 0, stub_site: str | None = None,
                 models: list[str] | None = None, host: str = "127.0.0.1", extra_args: tuple = ()):
        self.repo = Path(model_repository).resolve()
        # The address its three servers bind. Triton's default is every interface, and its
        # shared-memory API answers anyone who reaches it: from another host, a node's regions
        # (their names are predictable) were listed and unregistered, failing its requests.
        self.host = host
        self.grpc_port = grpc_port or _free_port()
        self.http_port = http_port or _free_port()
        self.metrics_port = metrics_port or _free_port()
        self.log_verbose = log_verbose
        self.stub_site = stub_site
        self.models = models  # load only these (explicit model control); None: the whole repository
        self.extra_args = tuple(extra_args)  # more tritonserver options (a bench's --trace-config)
        self.proc: subprocess.Popen | None = None
        self._workdir = PrivateDir("by-triton-")  # one killed outright leaves it to the next one's start
        self.workdir = self._workdir.path
        # The python backend names its /dev/shm regions <prefix><uuid>: ours alone start with this.
        self.shm_prefix = f"by_triton_{os.getpid()}_{secrets.token_hex(4)}_"
        self._reaper = False  # serve(): stubs orphaned by a crashed server become our children

    @property
    def grpc_url(self) -> str:
        return f"{self._dial_host}:{self.grpc_port}"

    @property
    def _dial_host(self) -> str:
        """Where its servers are reached from this host: the address they bind, loopback for
        every interface's (its readiness wait dialled 127.0.0.1 whatever --host said)."""
        return "127.0.0.1" if self.host in ("", "0.0.0.0", "::") else self.host

    def _backend_dir(self) -> Path:
        root = pytriton_root()
        dst = self.workdir / "backends" / "python"
        dst.mkdir(parents=True, exist_ok=True)
        src = root / "backends" / "python"
        for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
            shutil.copy2(src / name, dst / name)
        ver = f"{sys.version_info.major}.{sys.version_info.minor}"
        stub = root / "python_backend_stubs" / ver / "triton_python_backend_stub"
        if not stub.exists():
            raise RuntimeError(f"nvidia-pytriton has no python backend stub for Python {ver}")
        shutil.copy2(stub, dst / "triton_python_backend_stub")
        return self.workdir / "backends"

    def _env(self) -> dict:
        libs = [sysconfig.get_config_var("LIBDIR"), str(pytriton_root().parent.parent / "nvidia_pytriton.libs")]
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = ":".join(libs + [env.get("LD_LIBRARY_PATH", "")]).rstrip(":")
        site = sysconfig.get_paths()["purelib"]
        # The stub ignores PYTHONPATH (isolated interpreter); models that need our packages
        # add this site themselves (deploy/triton/cpu/model_amx/1/model.py).
        env["BATCHYARD_SITE_PATHS"] = site
        return env

    def start(self, ready_timeout_s: float = 60.0) -> "TritonLocal":
        if self.stub_site is None:
            self.stub_site = default_stub_site()
        cmd = [str(pytriton_root() / "bin" / "tritonserver"),
               f"--model-repository={self.repo}", f"--backend-directory={self._backend_dir()}",
               f"--grpc-address={self.host}", f"--http-address={self.host}", f"--metrics-address={self.host}",
               f"--grpc-port={self.grpc_port}", f"--http-port={self.http_port}",
               f"--metrics-port={self.metrics_port}", "--allow-metrics=true",
               f"--log-verbose={self.log_verbose}", "--exit-on-error=true", "--strict-readiness=true",
               f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
               f"--exit-timeout-secs={EXIT_TIMEOUT_S}"]
        if cuda_device_count() == 0:
            # No GPU: no pinned or CUDA pools (with them the python backend returned empty
            # outputs). With one, Triton's defaults.
            cmd += ["--pinned-memory-pool-byte-size=0", "--cuda-memory-pool-byte-size=0:0"]
        if self.models is not None:
            cmd += ["--model-control-mode=explicit"] + [f"--load-model={m}" for m in self.models]
        cmd += self.extra_args
        parent = os.getpid()
        with open(self.workdir / "tritonserver.log", "wb") as out:
            self.proc = subprocess.Popen(cmd, env=self._env(), stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, cwd=self.stub_site,
                                         preexec_fn=lambda: die_with_parent(parent))
        log.info("tritonserver pid %d starting (log %s)", self.proc.pid, self.workdir / "tritonserver.log")
        self.wait_ready(ready_timeout_s)
        return self

    def wait_ready(self, timeout_s: float) -> None:
        import tritonclient.grpc as grpcclient

        deadline = time.monotonic() + timeout_s
        client = grpcclient.InferenceServerClient(self.grpc_url)
        try:
            while True:
                if self._wait_exit(0):
                    self._end()
                    raise ServerExited(self.proc.returncode,
                                       f"tritonserver exited with {self.proc.returncode}:\n{self.log_tail()}")
                try:
                    if client.is_server_ready(client_timeout=1.0):
                        return
                except Exception:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tritonserver not ready within {timeout_s:.0f} s:\n{self.log_tail()}")
                time.sleep(0.1)  # readiness probe of an external server: there is no event to wait on
        finally:
            client.close()

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join((self.workdir / "tritonserver.log").read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the server and its stubs (to test outages); stop() still cleans up afterwards."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def _wait_exit(self, timeout_s: float | None) -> bool:
        """Until the server has exited (True) or ``timeout_s`` passed. Leaves it unreaped."""
        try:
            fd = os.pidfd_open(self.proc.pid)
        except ProcessLookupError:  # already reaped
            return True
        try:
            return bool(select.select([fd], [], [], timeout_s)[0])
        finally:
            os.close(fd)

    def _end(self) -> None:
        """The server has exited: SIGKILL what is left of its group (stubs of a crashed server;
        the unreaped server still holds the group id), then reap it."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        while self._reaper:  # those stubs: gone for good once reaped, not zombies of pid 1's
            try:
                os.waitpid(-self.proc.pid, 0)
            except ChildProcessError:
                break

    def stop(self, timeout_s: float = 2.0 * EXIT_TIMEOUT_S) -> None:
        if self.proc is not None and self.proc.returncode is None:
            if not self._wait_exit(0):
                os.killpg(self.proc.pid, signal.SIGTERM)
                if not self._wait_exit(timeout_s):
                    log.warning("tritonserver pid %d ignored SIGTERM for %.0f s: SIGKILL", self.proc.pid, timeout_s)
            self._end()
        # Regions the python backend leaves when the server or a stub is killed: ours alone.
        for name in os.listdir("/dev/shm"):
            if name.startswith(self.shm_prefix):
                try:
                    os.unlink(os.path.join("/dev/shm", name))
                except OSError:
                    pass

    def serve(self, ready_timeout_s: float = 120.0) -> int:
        """``batchyard triton-local``: start, then run until SIGTERM/SIGINT (returns 0) or until
        the server exits by itself (returns its exit status; 1 if that was 0: it was not asked
        to). Either way the server, its stubs and its regions are gone on return."""
        def stop_requested(signum, _frame):
            raise _StopRequested(signum)

        ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1)  # a process-wide setting: this command only
        self._reaper = True
        handlers = {s: signal.signal(s, stop_requested) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            try:
                self.start(ready_timeout_s)
                print(f"tritonserver ready: gRPC {self.grpc_url}, metrics "
                      f"http://{self._dial_host}:{self.metrics_port}/metrics", flush=True)
                self._wait_exit(None)
                self._end()
                rc = exit_status(self.proc.returncode)
                log.error("tritonserver exited by itself with %d; last lines of its log:\n%s", rc, self.log_tail(20))
                return rc or 1
            except ServerExited as e:
                log.error("%s", e)
                return exit_status(e.returncode) or 1
            except TimeoutError as e:
                log.error("%s", e)
                return 1
            except _StopRequested as e:
                log.info("%s: stopping tritonserver", signal.Signals(e.args[0]).name)
                return 0
        finally:
            for s in handlers:  # a second signal must not cut the cleanup short
                signal.signal(s, signal.SIG_IGN)
            self.close()
            for s, h in handlers.items():
                signal.signal(s, h)

    def close(self) -> None:
        self.stop()
        self._workdir.cleanup()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()
