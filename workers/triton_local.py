"""A real Triton Inference Server on this host, from the ``nvidia-pytriton`` wheel.

The wheel ships ``tritonserver`` (2.51) and the python backend. Started standalone it needs:
- a backend folder assembled from the wheel's ``libtriton_python.so``,
  ``triton_python_backend_utils.py`` and the stub built for *this* Python;
- ``LD_LIBRARY_PATH`` with the running interpreter's libpython and the wheel's
  ``nvidia_pytriton.libs`` (without them the stub cannot start and model load hangs instead
  of failing, hence the readiness deadline);
- our virtualenv's site-packages on the stub's ``PYTHONPATH`` (models import numpy/torch).
Killed hard, the python backend leaves ``/dev/shm`` regions and temp folders behind;
``stop()`` terminates gently, then removes what the server owned.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    import pytriton

    return Path(pytriton.__file__).parent / "tritonserver"


class TritonLocal:
    def __init__(self, model_repository: str | Path, grpc_port: int = 0, http_port: int = 0,
                 metrics_port: int = 0, log_verbose: int = 0, stub_site: str | None = None,
                 models: list[str] | None = None):
        self.repo = Path(model_repository).resolve()
        self.grpc_port = grpc_port or _free_port()
        self.http_port = http_port or _free_port()
        self.metrics_port = metrics_port or _free_port()
        self.log_verbose = log_verbose
        self.stub_site = stub_site
        self.models = models  # load only these (explicit model control); None: the whole repository
        self.proc: subprocess.Popen | None = None
        self.workdir = Path(tempfile.mkdtemp(prefix="by-triton-"))
        self._shm_before: set[str] = set()

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

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
        import pytriton

        libs = [sysconfig.get_config_var("LIBDIR"), str(Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs")]
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
        self._shm_before = set(os.listdir("/dev/shm"))
        cmd = [str(pytriton_root() / "bin" / "tritonserver"),
               f"--model-repository={self.repo}", f"--backend-directory={self._backend_dir()}",
               f"--grpc-port={self.grpc_port}", f"--http-port={self.http_port}",
               f"--metrics-port={self.metrics_port}", "--allow-metrics=true",
               f"--log-verbose={self.log_verbose}", "--exit-on-error=true", "--strict-readiness=true",
               # CPU-only host: no pinned or CUDA pools (the python backend then returned empty outputs).
               "--pinned-memory-pool-byte-size=0", "--cuda-memory-pool-byte-size=0:0"]
        if self.models is not None:
            cmd += ["--model-control-mode=explicit"] + [f"--load-model={m}" for m in self.models]
        log = open(self.workdir / "tritonserver.log", "wb")
        self.proc = subprocess.Popen(cmd, env=self._env(), stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=self.stub_site)
        self.wait_ready(ready_timeout_s)
        return self

    def wait_ready(self, timeout_s: float) -> None:
        import tritonclient.grpc as grpcclient

        deadline = time.monotonic() + timeout_s
        client = grpcclient.InferenceServerClient(self.grpc_url)
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"tritonserver exited with {self.proc.returncode}:\n{self.log_tail()}")
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
        """SIGKILL (to test outages); stop() still cleans up afterwards."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # The python backend's own regions (named after the server, not ours) left by a kill.
        for name in set(os.listdir("/dev/shm")) - self._shm_before:
            if name.startswith(("triton_python_backend_shm_region", "pb_")) or "triton" in name:
                try:
                    os.unlink(os.path.join("/dev/shm", name))
                except OSError:
                    pass

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()
