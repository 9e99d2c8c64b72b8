"""Shared-memory regions the Triton executor registers with the server: system (POSIX) or CUDA.

Both kinds have one interface: ``register``/``unregister`` with a Triton gRPC client, ``write``
a contiguous array at an offset, ``read`` an array back from an offset, ``close``. The executor
copies each batch into its slot's input region and reads outputs from its output region, so it
does not care which kind it holds.

CUDA regions use cuda-python's runtime bindings directly (``cudaMalloc`` + ``cudaIpcGetMemHandle``,
the same calls ``tritonclient.utils.cuda_shared_memory`` makes) rather than that module: its
``get_contents_as_numpy`` copies the whole region to the host on every read and its writes
always start at offset 0, while a slot holds several tensors at offsets and reads only what a
batch produced. cuda-python is imported only when a CUDA region is asked for.
"""

from __future__ import annotations

import base64
import ctypes
import os

import numpy as np

from batchyard.shm import Segment

from .runtime import CannotStart


CUDA_IPC_HANDLE_SIZE = 64


class RegionError(CannotStart):
    pass


class HostRegion:
    """A POSIX shared-memory segment registered with Triton's system shared memory extension."""

    kind = "system"

    def __init__(self, name: str, size: int):
        self.name = name
        self.seg = Segment.create(max(size, 64))
        self.size = self.seg.size

    def register(self, client, timeout_s: float) -> None:
        client.register_system_shared_memory(self.name, "/" + self.seg.name, self.size, client_timeout=timeout_s)

    def unregister(self, client, timeout_s: float) -> None:
        client.unregister_system_shared_memory(self.name, client_timeout=timeout_s)

    def write(self, offset: int, arr: np.ndarray) -> None:
        np.frombuffer(self.seg.mm, dtype=np.uint8, count=arr.nbytes, offset=offset)[:] = arr.reshape(-1).view(np.uint8)

    def read(self, offset: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        count = int(np.prod(shape))
        # A copy: the region is reused by the slot's next batch as soon as this one is handed back.
        return np.frombuffer(self.seg.mm, dtype=dtype, count=count, offset=offset).reshape(shape).copy()

    def close(self) -> None:
        self.seg.close()


def _cudart():
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cudart  # older cuda-python (what tritonclient 2.51 imports)
        except ImportError as e:
            raise RegionError(f"CUDA shared memory needs the cuda-python package "
                              f"of the driver's CUDA major version (pip install 'cuda-python==12.*'): {e}") from None
    return cudart


def _check(cudart, what: str, res):
    err, rest = res[0], res[1:]
    if err != cudart.cudaError_t.cudaSuccess:
        msg = cudart.cudaGetErrorString(err)[1]
        raise RegionError(f"{what} failed: {msg.decode() if isinstance(msg, bytes) else msg}")
    return rest[0] if len(rest) == 1 else rest


def cuda_device_count() -> int:
    """GPUs visible to this process; 0 when cuda-python or the driver is missing."""
    try:
        cudart = _cudart()
        return int(_check(cudart, "cudaGetDeviceCount", cudart.cudaGetDeviceCount()))
    except (RegionError, OSError, RuntimeError):
        return 0


class CudaRegion:
    """Device memory on GPU ``device`` exported by a CUDA IPC handle, registered with Triton's
    CUDA shared memory extension: the server reads inputs and writes outputs on the GPU, with
    no host staging on its side. The worker's copies in and out are plain ``cudaMemcpy`` calls
    from and to the batch's host arrays."""

    kind = "cuda"

    def __init__(self, name: str, size: int, device: int):
        self.cudart = cudart = _cudart()
        self.name, self.size, self.device = name, max(size, 64), device
        _check(cudart, "cudaSetDevice", cudart.cudaSetDevice(device))
        self.ptr = int(_check(cudart, "cudaMalloc", cudart.cudaMalloc(self.size)))
        handle = _check(cudart, "cudaIpcGetMemHandle", cudart.cudaIpcGetMemHandle(self.ptr))
        # The handle is 64 opaque bytes (CUDA_IPC_HANDLE_SIZE). cuda-python 12 exposed them as
        # `.reserved` (what tritonclient reads); 13 does not, but both have getPtr().
        self.raw_handle = base64.b64encode(ctypes.string_at(handle.getPtr(), CUDA_IPC_HANDLE_SIZE))

    def register(self, client, timeout_s: float) -> None:
        client.register_cuda_shared_memory(self.name, self.raw_handle, self.device, self.size,
                                           client_timeout=timeout_s)

    def unregister(self, client, timeout_s: float) -> None:
        client.unregister_cuda_shared_memory(self.name, client_timeout=timeout_s)

    # cudaMemcpyDefault: the direction comes from the pointers (unified addressing), so the copy
    # is right whatever device is current on the calling thread; reads run on gRPC threads.
    def write(self, offset: int, arr: np.ndarray) -> None:
        c = self.cudart
        _check(c, "cudaMemcpy to the GPU", c.cudaMemcpy(self.ptr + offset, arr.ctypes.data, arr.nbytes,
                                                        c.cudaMemcpyKind.cudaMemcpyDefault))

    def read(self, offset: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        c = self.cudart
        out = np.empty(shape, dtype=dtype)
        _check(c, "cudaMemcpy from the GPU", c.cudaMemcpy(out.ctypes.data, self.ptr + offset, out.nbytes,
                                                          c.cudaMemcpyKind.cudaMemcpyDefault))
        return out

    def close(self) -> None:
        if self.ptr:
            _check(self.cudart, "cudaFree", self.cudart.cudaFree(self.ptr))
            self.ptr = 0


def resolve_kind(kind: str, device: int) -> str:
    """"auto" means CUDA shared memory when this host has the GPU, system shared memory otherwise."""
    if kind == "auto":
        return "cuda" if cuda_device_count() > device else "system"
    if kind == "cuda" and cuda_device_count() <= device:
        _cudart()  # a missing package gets its own message
        raise RegionError(f"shm = \"cuda\" but no GPU {device} is visible to this worker "
                          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                          f"use shm = \"system\" or \"auto\"")
    return kind


def make_region(kind: str, name: str, size: int, device: int = 0):
    return CudaRegion(name, size, device) if kind == "cuda" else HostRegion(name, size)
