"""What ``Client`` and ``AsyncClient`` share: encoding requests, decoding replies, the table
of requests in flight and the client-owned shared-memory pool. No sockets and no waiting:
each client drives its own socket (the sync one from an I/O thread, the async one from the
event loop) and calls in here.

Threads: ``encode_*`` and ``alloc_array`` may run on any thread (ids come from an atomic
counter, the pool has its own lock). The in-flight table (``pending``/``late``) belongs to
the one thread that drives the socket: ``on_reply``, ``expire_local`` and ``fail_all`` are
called from there only.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import math
import numbers
import operator
import os
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Callable, Optional

import msgspec
import numpy as np
import zmq

from . import protocol as P
from .addresses import host_port
from .client_pool import Region, ShmPool
from .errors import Cancelled, DeadlineExceeded, InvalidArgument, Overloaded, Unavailable, error_for
from .protocol import Status
from .shm import CLIENT_REAP_ENTRIES, ShmError, reap_orphans
from .validation import item_nbytes

log = logging.getLogger("batchyard.client")

_DTYPE_NAMES: dict = {}


def dtype_name(dt: np.dtype) -> str:
    """``dt.name``, cached: numpy computes the name in Python on every access, and that was
    about 5 % of the front door's CPU per request (py-spy, 40 req/s)."""
    name = _DTYPE_NAMES.get(dt)
    if name is None:
        name = _DTYPE_NAMES[dt] = dt.name
    return name


DEFAULT_TIMEOUT_S = 30.0
REPLY_GRACE_S = 1.0
# How long a call without a timeout of its own waits for its model's spec (the node's default
# timeout comes with it); a call with one spends that on its set-up messages and the request.
SETUP_TIMEOUT_S = 10.0
# Tensors from this size on go through shared memory. Measured (bench/handoff.py, this
# machine): inline ZeroMQ and a pool copy cost about the same up to ~16 KiB; from 64 KiB on
# the pool wins and the gap grows with size (see docs/protocol.md).
DEFAULT_SHM_THRESHOLD = 64 << 10
INLINE_ONLY = 1 << 62  # a threshold no tensor reaches


def checked_timeout(timeout: Optional[float], name: str = "timeout") -> float:
    """A request's timeout in seconds (None: DEFAULT_TIMEOUT_S), or InvalidArgument."""
    timeout = DEFAULT_TIMEOUT_S if timeout is None else _seconds(timeout, name)
    if not 0 < timeout <= P.MAX_TIMEOUT_S:
        raise InvalidArgument(f"{name} must be > 0 and at most {P.MAX_TIMEOUT_S:g} seconds, got {timeout}")
    return timeout


def checked_model(model) -> str:
    """A model's name, or InvalidArgument (a list raised a bare TypeError on the client's lookup
    of its spec; an int or None reached the dispatcher, which refused it)."""
    if not isinstance(model, str):
        raise InvalidArgument(f"model must be a str, got {type(model).__name__}")
    return model


def checked_count(value, name: str) -> int:
    """A status long poll's count: an int the wire carries, else the dispatcher's refusal; an
    int past 2**63 - 1 raised the encoder's OverflowError on the caller."""
    if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value < 2 ** 63:
        raise InvalidArgument(f"{name} must be >= 0 and below 2**63, got {value}")
    return value


def checked_wait(wait) -> float:
    """A status long poll's ``wait`` in seconds (0: answer at once), or InvalidArgument: nan and
    inf reached the wire's integer conversion and raised ValueError / OverflowError there."""
    wait = _seconds(wait, "wait")
    if not 0 <= wait <= P.MAX_TIMEOUT_S:
        raise InvalidArgument(f"wait must be >= 0 and at most {P.MAX_TIMEOUT_S:g} seconds, got {wait}")
    return wait


def _seconds(value, name: str) -> float:
    """A number of seconds: what float() reads, but for a bool or text (float() read True as 1 s
    and "2" as 2 s, which the wire and the front door refuse)."""
    if isinstance(value, (bool, np.bool_, str, bytes, bytearray, memoryview)):
        raise InvalidArgument(f"{name} must be a number of seconds, got {value!r:.40}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise InvalidArgument(f"{name} must be a number of seconds, got {value!r:.40}") from None


def time_left(deadline: float, model: str) -> float:
    """What a call's ``deadline`` (monotonic) leaves; DeadlineExceeded once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise setup_timeout_error(model)
    return left


def setup_step_timeout(deadline: float, model: str) -> float:
    """How long one set-up message (a grant step) may wait: what the call's ``deadline`` leaves
    (it was capped at SETUP_TIMEOUT_S: a dispatcher away for 10 s failed submit(timeout=30) that
    it would have served on its return)."""
    return time_left(deadline, model)


def setup_timeout_error(model: str) -> DeadlineExceeded:
    return DeadlineExceeded(f"timeout passed while setting up the request for {model!r} (its spec, or the "
                            "grant of a shared-memory segment): the dispatcher answers slowly")


def timeout_us(timeout: float) -> int:
    """A checked timeout on the wire, in whole microseconds, at least 1: 0 there means "the
    dispatcher's default", and a timeout under 1 us became that (30 s)."""
    return max(1, math.ceil(timeout * 1e6))


def _index(value) -> int:
    """``operator.index`` but for a boolean (an int to Python, no count or token id to a user)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError
    return operator.index(value)


def checked_sampling(sampling) -> Optional[P.Sampling]:
    """A generation's sampling (vLLM's names: temperature, top_p, top_k, min_p, seed and the
    penalties) as a mapping or a ``Sampling``, checked against vLLM's bounds; None: greedy."""
    if sampling is None:
        return None
    if isinstance(sampling, P.Sampling):  # (built directly, its fields were never checked)
        sampling = msgspec.structs.asdict(sampling)
    if not isinstance(sampling, Mapping):
        raise InvalidArgument(f"sampling must be a dict of vLLM's sampling parameters, got {sampling!r:.80}")
    try:
        checked = msgspec.convert(dict(sampling), P.Sampling)
    except msgspec.ValidationError as e:
        raise InvalidArgument(f"sampling: {e}") from None
    if checked.seed == -1:
        # vLLM's "no seed" (SamplingParams), read before anything derives seeds from it (the
        # k-th of n completions gets seed + k: -1 gave its second completion seed 0, its first none)
        checked = msgspec.structs.replace(checked, seed=None)
    if "temperature" not in sampling:
        # vLLM samples at 1 without one; greedy here, these would be taken and do nothing.
        asked = [k for k, default in _SAMPLES_ONLY if sampling.get(k, default) not in (default, None)
                 and not (k == "top_k" and sampling[k] == -1)]
        if asked:
            raise InvalidArgument(f"sampling: {asked[0]} is given without a temperature; Batchyard decodes greedily "
                                  "when it is left out (vLLM samples at 1): give one, e.g. 1.0 - at "
                                  f"`$.{asked[0]}`")
    return checked


# Sampling fields that change nothing at temperature 0 (vLLM resets them there).
_SAMPLES_ONLY = (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0), ("seed", None))
# What vLLM samples with where neither a request nor its model says (SamplingParams' default,
# its OpenAI server's too): temperature 1, every other field neutral.
VLLM_TEMPERATURE = 1.0


def sampling_as_vllm(given: Mapping, defaults: Optional[Mapping] = None) -> P.Sampling:
    """The sampling a vLLM server runs a request with (its compatible routes: /v1/completions,
    Triton's): each field the request ``given``, else the model's ``defaults``
    (llm_model_files.generation_defaults, on /v1/completions), else vLLM's own, which sample
    at temperature 1. InvalidArgument naming a field of ``given`` past vLLM's bounds."""
    return checked_sampling({"temperature": VLLM_TEMPERATURE, **(defaults or {}), **given})


def checked_priority(priority) -> int:
    """A class name ("high", "normal", "low") or its number (0, 1, 2), or InvalidArgument."""
    if isinstance(priority, str):
        if priority not in PRIORITIES:
            raise InvalidArgument(f"priority {priority!r} not one of {list(PRIORITIES)}")
        return PRIORITIES[priority]
    if (isinstance(priority, bool) or not isinstance(priority, numbers.Integral)
            or not P.PRIORITY_HIGH <= priority <= P.PRIORITY_LOW):
        raise InvalidArgument(f"priority must be one of {list(PRIORITIES)} or "
                              f"{P.PRIORITY_HIGH}..{P.PRIORITY_LOW}, got {priority!r}")
    return int(priority)


PRIORITIES = {name: level for level, name in enumerate(P.PRIORITY_NAMES)}  # "high" -> 0, ...


# The reply each kind of request gets when it succeeds.
_REPLY_OF = {"infer": P.InferReply, "shm": P.ShmReply, "model_info": P.ModelInfoReply, "status": P.StatusReply,
             "generate": P.GenerateReply}


class Borrowed:
    """An ``alloc_array`` array a request sends by reference, in the request's list of regions:
    held, not freed, until the reply or the release (its own finalizer frees its region)."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array


def closed_error() -> Cancelled:
    """What a request gets when its client closes with it in flight, or is used after close
    (docs/protocol.md: CANCELLED, SDK-local)."""
    return Cancelled("client closed")


def forked_error() -> Cancelled:
    """``closed_error`` of a client used in the child of a fork of the process that made it."""
    return Cancelled("client closed: it was made in the parent of this forked process; make a new client here")


def no_reply_error(address: str) -> DeadlineExceeded:
    return DeadlineExceeded(f"no reply from the dispatcher at {address} before the deadline (is it running?)")


class InferResult(dict):
    """The outputs by name (a dict), plus ``timing`` from the dispatcher (queue/compute/total
    microseconds, batch size, path and worker)."""

    def __init__(self, outputs: dict, timing: Optional[P.Timing]):
        super().__init__(outputs)
        self.timing = timing


class Generation(list):
    """The generated token ids (a list), plus ``timing`` (LLM mode: TTFT, route, instances, KV
    tokens moved, and whether the "gpu" instance is a CPU stand-in) and ``finish_reason``:
    "stop" where it ended at the model's end-of-sequence token (the last of the ids), "length"
    at max_tokens. ``logprobs``: where the sampling asked them, one P.PositionLogprobs a token
    ((token id, logprob, rank) of the token decoded, then of the most likely ones); else [].
    ``prompt_logprobs``: likewise, one a prompt token but the first, where asked."""

    def __init__(self, tokens: list, timing: Optional[P.LlmTiming], finish_reason: str = "length",
                 logprobs: Optional[list] = None, prompt_logprobs: Optional[list] = None):
        super().__init__(tokens)
        self.timing = timing
        self.finish_reason = finish_reason
        self.logprobs = logprobs or []
        self.prompt_logprobs = prompt_logprobs or []


class StepTokens(list):
    """What ``on_tokens`` is given: the token ids of an engine step (a list), their
    ``logprobs`` and (the first step's) ``prompt_logprobs``, as Generation's."""

    def __init__(self, tokens: list, logprobs: list, prompt_logprobs: list):
        super().__init__(tokens)
        self.logprobs, self.prompt_logprobs = logprobs, prompt_logprobs


class EncodedInputs:
    """A request's inputs as read at submit: their references, the inline frames (copies), the
    pool regions they took and the segments those name. Its ``regions`` belong to it until
    ``encode_infer`` hands them to the request (``take``) or ``release_inputs`` frees them."""

    __slots__ = ("refs", "frames", "regions", "used", "n_items")

    def __init__(self):
        self.refs: list = []
        self.frames: list = []
        self.regions: list = []
        self.used: set = set()
        self.n_items = 0

    def take(self) -> list:
        regions, self.regions = self.regions, []
        return regions


def checked_inputs(inputs) -> Mapping:
    """``inputs`` with plain str names (a numpy or pandas string, a str subclass, is one; it
    was a TypeError from the encoder, and each such call leaked the pool it had taken)."""
    if not isinstance(inputs, Mapping):
        raise InvalidArgument(f"inputs must be a dict of input name -> array, got {type(inputs).__name__}")
    if all(type(name) is str for name in inputs):
        return inputs
    if not all(isinstance(name, str) for name in inputs):
        bad = next(name for name in inputs if not isinstance(name, str))
        raise InvalidArgument(f"input names must be strings, got {type(bad).__name__} {bad!r}")
    return {str(name): value for name, value in inputs.items()}


def refused(e: ShmError) -> Overloaded:
    """A full /dev/shm: this host's, typed as the SDK's errors are."""
    return Overloaded(f"shared memory for the request: {e}")


class Pending:
    """One request in flight: what to free when its reply comes, and whom to tell."""

    __slots__ = ("kind", "regions", "outputs", "resolve", "on_tokens", "streamed", "streamed_logprobs",
                 "prompt_logprobs")

    def __init__(self, kind: str, regions: list, outputs: dict, resolve: Callable[[object], None],
                 on_tokens: Optional[Callable[[list], None]] = None):
        self.kind = kind  # "infer" | "model_info" | "status"
        self.regions = regions  # input regions to free when the reply arrives
        self.outputs = outputs  # name -> Region the worker writes into
        self.resolve = resolve  # callable(result or exception)
        self.on_tokens = on_tokens  # a streamed generation's: callable(the next tokens decoded)
        self.streamed: list = []  # tokens given to on_tokens (the result of a generation it ends)
        self.streamed_logprobs: list = []  # ... and their logprobs
        self.prompt_logprobs: list = []  # ... and the prompt's, where asked


def node_opens_my_segments(address: str) -> bool:
    """Whether the node behind ``address`` can open this process's segments (mode 0600, this
    uid's): an ipc endpoint whose socket file is this uid's or root's (the dispatcher made it, as
    the node's user). A client of another uid beside a node of its own user (the systemd units'
    `batchyard`) had every tensor of 64 KiB or more refused: neither the dispatcher's proof nor a
    worker can open its segments, and making them group-readable would open them to every other
    client of the group. Such a client sends inline. An endpoint not there yet: assumed yes."""
    if address.startswith("tcp://"):
        return False
    path = address.removeprefix("ipc://")
    try:
        owner = os.stat(path).st_uid
    except (OSError, ValueError):  # not bound yet, an abstract name
        return True
    return owner in (os.getuid(), 0)


class ClientCodec:

    def __init__(self, address: str, *, shm_threshold: int = DEFAULT_SHM_THRESHOLD, pool_bytes: int = 64 << 20,
                 shared_memory: Optional[bool] = None):
        # A crashed client's segments go as soon as anyone starts; looking at a bounded number of
        # names (200,000 that anyone may make in /dev/shm made each new client wait seconds).
        reap_orphans(max_entries=CLIENT_REAP_ENTRIES)
        self.address = address
        # None: on an ipc endpoint only. A tcp endpoint refuses shared-memory references (unless
        # its node sets allow_shm_over_tcp: then pass True), and every tensor of 64 KiB or more,
        # alloc_array's included, was refused PERMISSION_DENIED: over tcp all goes inline.
        self.shared_memory = node_opens_my_segments(address) if shared_memory is None else shared_memory
        self.shm_threshold = shm_threshold if self.shared_memory else INLINE_ONLY
        self._pool_bytes = pool_bytes
        self._pool: Optional[ShmPool] = None
        self._pool_lock = threading.Lock()  # two threads' first big tensors must not make two pools
        self._pool_closed = False
        self._ids = itertools.count(1)  # next() on it is atomic: safe from any thread
        self.pending: dict[int, Pending] = {}
        self.late: dict[int, list[Region]] = {}  # timed out locally; free regions on late reply
        self.finishing: list[bytes] = []  # cancels (finished) of generations their on_tokens ended, to send
        self._array_regions: dict[int, Region] = {}  # data address -> region, for alloc_array
        self.specs: dict[str, P.ModelSpec] = {}
        # The node's max_inline_bytes, as its model_info replies say (a request is encoded after
        # its model's spec came): None until then, or from a dispatcher that does not say.
        self.max_inline_bytes: Optional[int] = None
        # The node's default_timeout_s, as its model_info replies say: a request without a
        # timeout takes it (it took the SDK's 30 s, whatever the operator set).
        self.node_timeout_s: Optional[float] = None
        self.said_node_timeout_s: Optional[float] = None  # the latest one said, kept past a lost connection
        # Why the dispatcher refused this connection for good (connection_lost): a request sent
        # after it fails at once. Sent after the refusal came (the client's first request raced
        # the handshake), it waited out its whole timeout: "no reply ... (is it running?)".
        self.refused = ""
        self.granted: set[str] = set()  # segments this connection may reference (shm_grants.py)
        # Counts lost connections. A grant is recorded only if no connection was lost since its
        # registration began: one answered just before a restart, recorded after the I/O thread
        # had cleared ``granted``, was kept, and the new dispatcher refused every request naming
        # that segment (PERMISSION_DENIED) until the next disconnection.
        self.connection = 0
        self._grants_lock = threading.Lock()

    def next_id(self) -> int:
        return next(self._ids)

    # ---------------------------------------------------------------- shared memory
    @property
    def pool(self) -> ShmPool:
        if self._pool is None:
            with self._pool_lock:
                if self._pool_closed:  # a closed client must not make a new pool nobody frees
                    raise closed_error()
                if self._pool is None:
                    self._pool = ShmPool(self._pool_bytes, on_removed=self._forget_grant)
        return self._pool

    def alloc_array(self, shape, dtype) -> np.ndarray:
        """A numpy array living in this client's shared memory. Fill it in place and pass it
        to infer(): it is sent by reference, with no copy."""
        try:
            dtype = np.dtype(dtype)
            dims = (operator.index(shape),) if isinstance(shape, numbers.Integral) else tuple(map(operator.index, shape))
        except TypeError as e:
            raise InvalidArgument(f"alloc_array({shape!r}, {dtype!r}): {e}") from None
        # Checked before the pool is: numpy refused an object dtype only after the region was
        # taken, and the region was never given back; a negative dimension made an empty array.
        if dtype.name not in P.DTYPES or dtype.hasobject or any(d < 0 for d in dims):
            raise InvalidArgument(f"alloc_array: shape {list(dims)} of {dtype} is not a tensor a model takes "
                                  f"(dtypes: {', '.join(sorted(P.DTYPES))}; dimensions >= 0)")
        nbytes = math.prod(dims) * dtype.itemsize
        if nbytes >= 2 ** 63:  # (a C long: the pool's OverflowError, numpy's ValueError, both bare)
            raise InvalidArgument(f"alloc_array: shape {list(dims)} of {dtype} is {nbytes} bytes, more than "
                                  "memory can hold")
        if not self.shared_memory:  # sent inline anyway: plain memory
            return np.empty(dims, dtype)
        try:
            region = self.pool.alloc(nbytes)
        except ShmError as e:  # a full /dev/shm
            raise Overloaded(f"shared memory for an array of {nbytes} bytes: {e}") from None
        base = np.frombuffer(self.pool.view(region), dtype=dtype)
        addr = base.__array_interface__["data"][0]
        self._array_regions[addr] = region
        # On the buffer's own array, which every view of it (a slice, .T, .ravel()) keeps alive:
        # on the reshaped array, the region went back to the pool while a slice still used it.
        weakref.finalize(base, self._release_array, addr, region)
        return base.reshape(dims)

    def _release_array(self, addr: int, region: Region) -> None:
        self._array_regions.pop(addr, None)
        self.free(region)

    def free(self, region) -> None:
        if self._pool is not None and type(region) is Region:  # a Borrowed array is only let go
            self._pool.free(region)

    def forked_off(self) -> None:
        """In a forked child: the pool is the parent's. Closed here without a lock a thread of the
        parent may have held at the fork (the child's exit hung on it), and never lent again (a
        child's array and the parent's next one were the same memory)."""
        self._pool_lock = threading.Lock()
        self._pool_closed = True
        if self._pool is not None:
            self._pool.forked_off()

    def close_pool(self) -> None:
        with self._pool_lock:
            self._pool_closed = True
        if self._pool is not None:
            self._pool.close()

    # ---------------------------------------------------------------- encode
    def call_timeout(self, timeout: Optional[float]) -> float:
        """A call's timeout, checked: None is the node's default_timeout_s once a model_info
        reply said it, else DEFAULT_TIMEOUT_S."""
        return checked_timeout(self.node_timeout_s if timeout is None else timeout)

    def spec_wait(self, timeout: Optional[float]) -> float:
        """How long a call's request for its model's spec may wait: the call's own (checked)
        timeout (it was capped at SETUP_TIMEOUT_S: submit(timeout=30) as a model's first call
        failed after 10 s while its dispatcher restarted, and the next call was served); without
        one, the node's default as its dispatcher last said it (a lost connection asks the specs
        again: without it, a call with no timeout failed after 10 s while the node's default was
        30 s, and the dispatcher was back at 13 s), else SETUP_TIMEOUT_S, as that default comes
        with the spec."""
        if timeout is not None:
            return checked_timeout(timeout)
        return SETUP_TIMEOUT_S if self.said_node_timeout_s is None else self.said_node_timeout_s

    @contextlib.contextmanager
    def fetching_spec(self, timeout: Optional[float], model: str):
        """Around a call's request for its model's spec (both clients): one that got no reply
        within the call's own timeout says so, as the likelier cause beside a dispatcher not
        running (infer(timeout=1e-6) as a model's first call, at a node that answers, was asked
        only "(is it running?)")."""
        try:
            yield
        except DeadlineExceeded:
            if timeout is not None:
                raise DeadlineExceeded(f"no reply from the dispatcher at {self.address} with the spec of {model!r} "
                                       f"within the call's timeout ({timeout:g} s), which a model's first call "
                                       "spends on fetching it first (is the timeout too short for a first call, or "
                                       "the dispatcher not running?)") from None
            raise

    def call_deadline(self, start: float, timeout: Optional[float], fetched: bool, model: str) -> tuple[float, float]:
        """A call's (timeout, deadline): its timeout checked (None: the node's default, which the
        spec fetched first brings), counted from ``start``; after that fetch, what it leaves."""
        timeout = self.call_timeout(timeout)
        deadline = start + timeout
        return (time_left(deadline, model) if fetched else timeout), deadline

    def needs_spec(self, model: str) -> bool:
        """The spec (fetched once per model) says which outputs are big enough for shm. (Every
        infer asks it first: a model named by something other than a str is refused here.)"""
        return checked_model(model) not in self.specs

    def encode_infer(self, model: str, inputs, priority, timeout: Optional[float]):
        """-> (id, frames, input regions, output regions by name, timeout in s, segments this
        connection has no grant for yet: the caller registers those before sending it).
        ``inputs``: a dict, or what ``encode_inputs`` made of one (its regions are then the
        request's, or freed if this fails)."""
        encoded = inputs if type(inputs) is EncodedInputs else None
        regions = encoded.take() if encoded is not None else []
        outputs, out_refs = {}, {}
        try:
            priority = checked_priority(priority)
            timeout = checked_timeout(timeout)
            if encoded is None:
                refs, frames, used = [], [], set()
                n_items = self._input_refs(checked_inputs(inputs), refs, frames, regions, used)
            else:
                refs, frames, used, n_items = encoded.refs, encoded.frames, encoded.used, encoded.n_items
            self._refuse_over_inline_limit(frames)
            self._output_regions(model, n_items, outputs, out_refs, used)
            rid = self.next_id()
            try:
                header = P.encode(P.InferRequest(v=P.PROTOCOL_VERSION, id=rid, model=str(model), inputs=refs,
                                                 priority=priority, timeout_us=timeout_us(timeout),
                                                 outputs=out_refs))
            except (TypeError, ValueError) as e:  # (UnicodeEncodeError: a name with a lone surrogate)
                raise InvalidArgument(f"the request cannot be encoded: {e}") from None
        except BaseException as e:
            # Refused half-way (a later input's dtype, a full /dev/shm, a name the encoder refuses):
            # what was allocated for the earlier ones goes back, or each refused call leaked it
            # (and the pool grew a segment).
            for region in (*regions, *outputs.values()):
                self.free(region)
            if isinstance(e, ShmError):
                raise refused(e) from None
            raise
        return rid, [header, *frames], regions, outputs, timeout, used - self.granted

    def encode_inputs(self, inputs) -> EncodedInputs:
        """Read the inputs now (AsyncClient.submit, before its Task runs): see ``_input_refs``."""
        encoded = EncodedInputs()
        try:
            encoded.n_items = self._input_refs(checked_inputs(inputs), encoded.refs, encoded.frames,
                                               encoded.regions, encoded.used)
        except BaseException as e:
            self.release_inputs(encoded)
            if isinstance(e, ShmError):
                raise refused(e) from None
            raise
        return encoded

    def release_inputs(self, encoded: EncodedInputs) -> None:
        """Free what ``encoded`` still holds of the pool (a request that was never sent)."""
        for region in encoded.take():
            self.free(region)

    def _refuse_over_inline_limit(self, frames: list) -> None:
        """InvalidArgument, as the dispatcher words it, for inline tensors over the node's
        max_inline_bytes. Sent, one frame past the node's ZeroMQ limit (max_inline_bytes + 1 MiB
        by default) was not refused: ZeroMQ dropped this client's connection, and every other
        request in flight on it failed UNAVAILABLE (on tcp, where all goes inline)."""
        limit = self.max_inline_bytes
        if limit is None:
            return
        total = sum(frame.nbytes for frame in frames)
        if total > limit:
            raise InvalidArgument(f"inline payload {total} bytes exceeds max_inline_bytes {limit}; "
                                  + (f"this client sends tensors under its shm_threshold ({self.shm_threshold} bytes) "
                                     "inline: lower shm_threshold, or pass arrays made by alloc_array(), to send them "
                                     "through shared memory, or raise the node's max_inline_bytes"
                                     if self.shared_memory else
                                     "this client sends tensors inline (shared_memory=False, a tcp endpoint's "
                                     "default): raise the node's max_inline_bytes, or send them through shared "
                                     "memory (an ipc endpoint, or shared_memory=True where the node sets "
                                     "allow_shm_over_tcp)"))

    @staticmethod
    def retimed(header: bytes, timeout: float) -> bytes:
        """An infer request's header with ``timeout`` (what set-up steps left of the call's)."""
        msg = P.client_message_decoder.decode(header)
        return P.encode(msgspec.structs.replace(msg, timeout_us=timeout_us(timeout)))

    def _input_refs(self, inputs: Mapping, refs: list, frames: list, regions: list, used: set) -> int:
        """Each input as a reference to shared memory (the pool's, or an ``alloc_array``'s) or to
        a frame, appended to ``refs`` and ``frames``; what it takes of the pool to ``regions``, the
        segments it names to ``used``. -> the items of the request. The inputs are read here:
        inline ones are copied, big ones copied into the pool, ``alloc_array`` arrays sent by
        reference; what the caller writes into its arrays afterwards is not what is sent."""
        n_items = 0
        for name, value in inputs.items():
            swapped = False
            try:
                arr = np.asarray(value)
            except (ValueError, TypeError) as e:  # a ragged nested list; a torch bfloat16 tensor
                raise InvalidArgument(f"input {name!r} is not an array: {e}") from None
            if not arr.dtype.isnative:  # the wire's bytes are native; a '>f4' array is named float32 too
                arr = arr.astype(arr.dtype.newbyteorder("="))
                swapped = True
            n_items = arr.shape[0] if arr.ndim else 0
            dtype = dtype_name(arr.dtype)
            if dtype not in P.DTYPES:
                # Refused here, not by the dispatcher: an array of this kind (datetime64, object)
                # may have no buffer to send, and a frame that fails to send killed the sync
                # client's I/O thread, failing every later call of every thread sharing it.
                raise InvalidArgument(f"input {name!r}: dtype '{dtype}' is not a tensor type Batchyard carries; "
                                      f"one of {sorted(P.DTYPES)}")
            # Only arrays from alloc_array have a region; most callers never make one.
            region = (self._array_regions.get(arr.__array_interface__["data"][0])
                      if self._array_regions and arr.nbytes else None)
            if not (region is not None and region.nbytes == arr.nbytes and arr.flags.c_contiguous):
                region = None  # not an alloc_array array: copy it into the pool if it is big
                if arr.nbytes >= self.shm_threshold:
                    region = self.pool.alloc(arr.nbytes)
                    regions.append(region)
                    np.frombuffer(self.pool.view(region), dtype=arr.dtype).reshape(arr.shape)[...] = arr
            elif region is not None:
                # Sent by reference: the array is held with the request's regions until its
                # reply or release, or dropped by the caller, it went back to the pool while the
                # worker still read it (and the next alloc_array's data was read instead).
                regions.append(Borrowed(arr))
            if region is not None:
                used.add(region.segment)
                refs.append(P.TensorRef(name=name, dtype=dtype, shape=list(arr.shape),
                                        shm=P.ShmRef(region.segment, region.offset, region.nbytes)))
            else:
                refs.append(P.TensorRef(name=name, dtype=dtype, shape=list(arr.shape), frame=len(frames)))
                # A copy, made now: the I/O thread sends the frame later and without copying, and
                # a buffer the caller refilled after submit() was sent with its new contents (the
                # request computed on the next one's data). One copy: an array made here (from a
                # list, or byte-swapped) is ours already; an ndarray or a buffer is the caller's.
                ours = swapped or type(value) in (list, tuple)
                frames.append(np.ascontiguousarray(arr) if ours else arr.copy())
        return n_items

    def _output_regions(self, model: str, n_items: int, outputs: dict, out_refs: dict, used: set) -> None:
        """Pool regions for the outputs big enough for shared memory, as the model's spec sizes them."""
        spec = self.specs.get(model)
        if spec is not None and n_items:
            for t in spec.outputs:
                nbytes = n_items * item_nbytes(t)
                if nbytes >= self.shm_threshold:
                    region = self.pool.alloc(nbytes)
                    outputs[t.name] = region
                    used.add(region.segment)
                    out_refs[t.name] = P.ShmRef(region.segment, region.offset, region.nbytes)

    def encode_shm_register(self, segment: str, proved: bool) -> tuple[int, list]:
        rid = self.next_id()
        return rid, [P.encode(P.ShmRegisterRequest(v=P.PROTOCOL_VERSION, id=rid, segment=segment, proved=proved))]

    def answer_challenge(self, segment: str, challenge: bytes) -> None:
        self.pool.write_header(segment, challenge)

    def _forget_grant(self, segment: str) -> None:
        """A segment the pool removed: its grant goes (kept, the set grew by each one for good)."""
        with self._grants_lock:
            self.granted.discard(segment)

    def add_grant(self, segment: str, connection: int) -> None:
        """Record ``segment`` as granted by a registration begun on ``connection`` (the value of
        ``self.connection`` then); Unavailable if that connection has been lost since: the grant
        was the old dispatcher's, and the new one must be asked again."""
        with self._grants_lock:  # against lost_connection's clear on the I/O thread
            if self.connection == connection:
                self.granted.add(segment)
                return
        raise Unavailable(f"lost the connection to the dispatcher ({self.address}) while registering shared "
                          "memory: the request was not sent")

    def encode_generate(self, model: str, prompt, max_tokens: int, priority, timeout: Optional[float],
                        route: str = "", on_tokens=None, ignore_eos: bool = False,
                        sampling=None) -> tuple[int, list, float]:
        """-> (id, frames, how long to wait for the reply). Without a ``timeout`` before a
        model_info reply said the node's default (an LLM-only client asks none), the request
        names none (``timeout_us`` 0: the node's default applies) and the wait is the node's to
        end; a lost or stopped dispatcher still fails it (the connection's liveness). An
        ``on_tokens`` (not None) streams it, and must be callable. ``ignore_eos``: decode
        max_tokens past the model's end-of-sequence token too; ``sampling``: see checked_sampling."""
        if not isinstance(ignore_eos, bool):
            raise InvalidArgument(f"ignore_eos must be a boolean, got {ignore_eos!r:.40}")
        if on_tokens is not None and not callable(on_tokens):
            raise InvalidArgument(f"on_tokens must be callable (it is given each step's tokens), got {on_tokens!r:.80}")
        node_decides = timeout is None and self.node_timeout_s is None
        timeout = P.MAX_TIMEOUT_S if node_decides else self.call_timeout(timeout)
        prio = checked_priority(priority)
        # operator.index: Python and numpy integers (the wire's encoder takes only ints); a float or
        # a string is refused, not truncated or read digit by digit. Bytes and booleans too: b"ab"
        # was the tokens 97 and 98, True the token 1 (and max_tokens=True one token).
        try:
            if isinstance(prompt, (bytes, bytearray, memoryview)):
                raise TypeError
            tokens = [_index(t) for t in prompt]
        except TypeError:
            raise InvalidArgument("prompt must be a sequence of token ids (the SDK does not tokenize text), "
                                  f"got {prompt!r:.80}") from None
        if not tokens or not all(0 <= t <= P.MAX_TOKEN_ID for t in tokens):
            raise InvalidArgument(f"prompt must be one or more token ids in [0, 2**31), got {prompt!r:.80}")
        if len(tokens) > P.MAX_PROMPT_TOKENS:
            # Sent, a message past the dispatcher's frame limit closed this client's connection,
            # and every other request in flight on it lost its reply.
            raise InvalidArgument(f"prompt of {len(tokens)} tokens; a request takes at most {P.MAX_PROMPT_TOKENS}")
        try:
            n = _index(max_tokens)
        except TypeError:
            n = 0
        if not 1 <= n <= P.MAX_NEW_TOKENS:
            raise InvalidArgument(f"max_tokens must be an integer in 1..{P.MAX_NEW_TOKENS}, got {max_tokens!r:.40}")
        route = "" if route is None else route  # None: the dispatcher chooses, as HTTP's null
        rid = self.next_id()
        msg = P.GenerateRequest(v=P.PROTOCOL_VERSION, id=rid, model=model, prompt=tokens, max_tokens=n,
                                priority=prio, timeout_us=0 if node_decides else timeout_us(timeout), route=route,
                                stream=on_tokens is not None, ignore_eos=ignore_eos,
                                sampling=checked_sampling(sampling))
        return rid, [P.encode(msg)], timeout

    def encode_model_info(self, model: str) -> tuple[int, list]:
        rid = self.next_id()
        return rid, [P.encode(P.ModelInfoRequest(v=P.PROTOCOL_VERSION, id=rid, model=model))]

    def encode_status(self, min_registrations: int, wait: float, min_departures: int = 0,
                      brief: bool = False) -> tuple[int, list]:
        """``wait``: checked (``checked_wait``) by the caller, which also sizes its own wait by it."""
        checked_count(min_registrations, "min_registrations")
        checked_count(min_departures, "min_departures")
        rid = self.next_id()
        return rid, [P.encode(P.StatusRequest(v=P.PROTOCOL_VERSION, id=rid, min_registrations=min_registrations,
                                              wait_us=int(wait * 1e6), min_departures=min_departures,
                                              brief=brief))]

    @staticmethod
    def encode_cancel(rid: int) -> bytes:
        return P.encode(P.CancelRequest(v=P.PROTOCOL_VERSION, id=rid))

    # ---------------------------------------------------------------- decode (socket thread)
    def on_reply(self, frames: list) -> None:
        try:
            msg = P.reply_decoder.decode(frames[0])
        except P.DecodeError:
            return  # not ours to crash over; the request will time out with a clear message
        if type(msg) is P.GenerateTokens:  # a streamed generation's next tokens; its reply follows
            pend = self.pending.get(msg.id)
            if pend is None or pend.on_tokens is None:
                return
            if msg.start not in (len(pend.streamed), -1):
                # A gap (a message lost past a full queue): the pieces stop here, and the
                # reply's tokens past those given are the rest, in order.
                pend.on_tokens = None
                return
            try:
                logprobs, prompt_logprobs = P.decode_logprobs(msg.logprobs), P.decode_logprobs(msg.prompt_logprobs)
            except P.DecodeError:  # (the reply's, read again, fails the request)
                pend.on_tokens = None
                return
            pend.streamed += msg.tokens
            pend.streamed_logprobs += logprobs
            pend.prompt_logprobs += prompt_logprobs
            try:
                enough = pend.on_tokens(StepTokens(msg.tokens, logprobs, prompt_logprobs))
            except BaseException:  # noqa: BLE001 -- the caller's: its generation's reply still comes
                # (a BaseException too, as a done-callback's: asyncio.CancelledError from a callback
                # that bridged into a cancelled task ended the I/O thread, and with it the client
                # for every thread)
                log.exception("on_tokens of request %d raised", msg.id)
                return
            if enough is True:
                # The caller has what it needs (a stop string): the generation ends now, its
                # result the tokens given; the dispatcher stops it and counts it served.
                del self.pending[msg.id]
                self.finishing.append(P.encode(P.CancelRequest(v=P.PROTOCOL_VERSION, id=msg.id, finished=True)))
                pend.resolve(Generation(list(pend.streamed), None, "stop", list(pend.streamed_logprobs),
                                        list(pend.prompt_logprobs)))
            return
        if type(msg) is P.Release and msg.id in self.pending:
            return  # a release follows an in_flight answer: one for a request still waiting is not its answer
        pend = self.pending.pop(msg.id, None) if msg.id is not None else None
        if pend is None:  # a late reply, or the release of an answered request's batch
            if type(msg) is P.InferReply and msg.in_flight:
                return  # still running: its `release` frees the regions
            for region in self.late.pop(msg.id, None) or ():
                self.free(region)
            return
        if type(msg) is P.InferReply and msg.in_flight:
            # Answered while its batch still runs: the worker may yet read the inputs and write
            # the outputs, so the regions stay reserved until the dispatcher's `release`.
            self.late[msg.id] = [*pend.regions, *pend.outputs.values()]
            pend.resolve(error_for(msg.status, msg.message))
            return
        for region in pend.regions:
            self.free(region)
        if type(msg) is not _REPLY_OF[pend.kind] and (type(msg) is not P.InferReply or msg.status == Status.OK):
            # A reply of another kind (an error comes as an InferReply to any request): read as
            # this request's, it raised on the I/O thread, which ended the client for every
            # thread, and this request, already taken from the pending ones, was never settled.
            for region in pend.outputs.values():
                self.free(region)
            pend.resolve(error_for(Status.INTERNAL, f"malformed reply from the dispatcher: a {type(msg).__name__} "
                                                    f"to a {pend.kind} request"))
            return
        if msg.status != Status.OK:
            for region in pend.outputs.values():
                self.free(region)
            pend.resolve(error_for(msg.status, msg.message, getattr(msg, "param", "")))
            return
        if pend.kind == "shm":
            pend.resolve(msg.challenge)
        elif pend.kind == "model_info":
            if msg.max_inline_bytes is not None:
                self.max_inline_bytes = msg.max_inline_bytes
            if msg.default_timeout_us:
                self.node_timeout_s = self.said_node_timeout_s = min(msg.default_timeout_us / 1e6, P.MAX_TIMEOUT_S)
            self.specs[msg.spec.name] = msg.spec
            pend.resolve(msg.spec)
        elif pend.kind == "status":
            pend.resolve(msg)
        elif pend.kind == "generate":
            try:
                logprobs, prompt_logprobs = P.decode_logprobs(msg.logprobs), P.decode_logprobs(msg.prompt_logprobs)
            except P.DecodeError as e:  # (the engine's, relayed unread by the dispatcher)
                pend.resolve(error_for(Status.INTERNAL, f"the generation's logprobs are malformed: {e}"))
                return
            pend.resolve(Generation(msg.tokens, msg.timing, msg.finish_reason or "length", logprobs,
                                    prompt_logprobs))
        else:
            try:
                result = self._outputs(msg, frames[1:], pend.outputs)
            except (IndexError, KeyError, ValueError, TypeError) as e:
                # A reply that does not match its own header fails its request, not the I/O
                # thread (every other request of this client would then wait out its timeout).
                result = error_for(Status.INTERNAL, f"malformed reply from the dispatcher: {e!r}")
            pend.resolve(result)

    def _outputs(self, msg: P.InferReply, frames: list, regions: dict) -> InferResult:
        out = {}
        for ref in msg.outputs:
            if ref.shm is not None:
                region = regions.pop(ref.name)
                base = np.frombuffer(self.pool.view(region), dtype=ref.dtype, count=math.prod(ref.shape))
                weakref.finalize(base, self.free, region)  # every view of the output keeps it (alloc_array)
                arr = base.reshape(ref.shape)
            else:
                arr = np.frombuffer(frames[ref.frame], dtype=ref.dtype).reshape(ref.shape)
            out[ref.name] = arr
        for region in regions.values():  # reserved but not used
            self.free(region)
        return InferResult(out, msg.timing)

    def expire_local(self, rid: int) -> Optional[Pending]:
        """Forget a request locally; its regions stay reserved until the late reply (if any)
        comes, so a worker still running it never writes into memory handed out again."""
        pend = self.pending.pop(rid, None)
        if pend is not None and (pend.regions or pend.outputs):
            self.late[rid] = [*pend.regions, *pend.outputs.values()]
        return pend

    def drop_unsent(self, rid: int) -> None:
        """A request that expired or was cancelled locally before it left this process: no
        worker will see its regions and no late reply will free them, so they go back now."""
        for region in self.late.pop(rid, None) or ():
            self.free(region)

    def flush(self, outbox: collections.deque, send: Callable[[list], None]) -> bool:
        """Send ``outbox``'s (request id or None, frames) in order while ``send`` takes them (it
        raises zmq.Again over the socket's high-water mark). Requests that expired or were
        cancelled meanwhile are dropped unsent; one with a frame that cannot be sent fails alone
        (left to escape, the error stopped the send, and every request behind it waited out its
        timeout). Whether any went. Both clients' outboxes: Client's I/O thread, AsyncClient's loop."""
        went = False
        while outbox:
            rid, frames = outbox[0]
            if rid is not None and rid not in self.pending:
                outbox.popleft()
                self.drop_unsent(rid)
                continue
            try:
                send(frames)
            except zmq.Again:
                break
            except (TypeError, ValueError) as e:  # a frame with no buffer: that request's fault alone
                if rid is not None:
                    self.fail_unsent(rid, InvalidArgument(f"a tensor of this request cannot be sent: {e}"))
            outbox.popleft()
            went = True
        return went

    def fail_unsent(self, rid: int, error: BaseException) -> None:
        """Fail a request that never left this process: no worker saw its regions."""
        pend = self.pending.pop(rid, None)
        if pend is not None:
            self._fail_freeing(pend, error)

    def cancels_of_generations(self) -> list[bytes]:
        """A `cancel` for each generation in flight, for a client that closes: answered here
        Cancelled("client closed"), each went on decoding in its engine to its max_tokens for
        nobody, holding a slot and its KV blocks (an infer runs its one batch at most)."""
        return [self.encode_cancel(rid) for rid, pend in self.pending.items() if pend.kind == "generate"]

    def fail_all(self, error_factory: Callable[[], BaseException]) -> None:
        """Resolve every request in flight with an error (the client is closing)."""
        pending, self.pending = self.pending, {}
        for pend in pending.values():
            self._fail_freeing(pend, error_factory())

    def fail_all_forked(self, error_factory: Callable[[], BaseException]) -> None:
        """In a fork's child: resolve the parent's requests this copy still lists (their replies
        go to the parent; nothing here would ever settle them), freeing none of their memory,
        which is the parent's."""
        pending, self.pending = self.pending, {}
        for pend in pending.values():
            pend.resolve(error_factory())

    def _fail_freeing(self, pend: Pending, error: BaseException) -> None:
        for region in (*pend.regions, *pend.outputs.values()):
            self.free(region)
        pend.resolve(error)

    def lost_connection(self) -> set[int]:
        """The connection to the dispatcher is gone: a new one has no shared-memory grants (they
        are asked for again). Returns the requests in flight on it, to ``fail_lost`` after
        LOST_GRACE_S: replies the dispatcher sent just before it went (a drained batch's) may
        still be on their way through ZeroMQ, which reports the disconnection first."""
        with self._grants_lock:
            self.connection += 1
            self.granted.clear()
        # A restarted dispatcher may serve a model of another shape: asked again, not sized from
        # the old spec (outputs' shm regions too small for the new one were refused); its limit
        # on inline bytes comes with the specs.
        self.specs.clear()
        self.max_inline_bytes = None
        self.node_timeout_s = None
        return set(self.pending)

    def fail_lost(self, rids: set[int], error_factory: Callable[[], BaseException]) -> None:
        """Fail those of ``rids`` still unanswered; their regions stay reserved (``late``): a
        worker of the old dispatcher may still be running their batch."""
        for rid in rids:
            pend = self.pending.pop(rid, None)
            if pend is None:
                continue
            if pend.regions or pend.outputs:
                self.late[rid] = [*pend.regions, *pend.outputs.values()]
            pend.resolve(error_factory())


# ZeroMQ heartbeats on the DEALER: a dispatcher that stops answering PINGs (host gone, network
# cut) is disconnected after HEARTBEAT_TIMEOUT_MS; a dispatcher process that dies closes the
# connection at once. Either way the socket monitor reports it and the requests in flight fail
# UNAVAILABLE then, not at their full timeout. ZeroMQ reconnects by itself afterwards.
HEARTBEAT_IVL_MS = 1000
# Messages a client's socket queues each way before a send must wait (the dispatcher away).
DEALER_HWM = 100_000
LOST_GRACE_S = 0.1
# How long a closing client's socket may take to send the cancels of its generations: close()
# is not to wait for a node that is gone (a cancel left unsent then only means the generation
# runs to its deadline, as it did before any was sent).
CANCELS_LINGER_MS = 200
HEARTBEAT_TIMEOUT_MS = 3000
_LOST = {zmq.EVENT_DISCONNECTED: "lost the connection to the dispatcher",
         zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the dispatcher refused this client's CURVE key",
         zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake with the dispatcher failed",
         zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake with the dispatcher failed"}
# A CURVE node drops a client that offers no key (PROTOCOL) or the wrong server key (NO_DETAIL).
_CURVE_HINT = (" (if the node uses CURVE: this client needs its keys, curve_server_key and curve_keys; "
               "`batchyard status --config` uses the node's own)")
_MAY_BE_CURVE = {_LOST[zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL], _LOST[zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL]}


def open_dealer(ctx: zmq.Context, address: str, curve_server_key: Optional[bytes] = None,
                curve_keys: Optional[tuple[bytes, bytes]] = None) -> tuple[zmq.Socket, zmq.Socket]:
    """The client's DEALER socket, connected, and a PAIR socket that receives its
    disconnection events; the same settings for both clients. ``curve_server_key`` (z85) and
    ``curve_keys`` (public, secret; from ``batchyard keygen``) for a CURVE-secured tcp endpoint."""
    sock = ctx.socket(zmq.DEALER)
    try:
        monitor = _setup_dealer(sock, address, curve_server_key, curve_keys)
    except BaseException as e:
        # Closed here (the monitor by _setup_dealer): the caller's ctx.term() would otherwise
        # wait for them forever; a bad address hung Client("foo") instead of raising.
        sock.close(linger=0)
        if isinstance(e, zmq.ZMQError):
            raise InvalidArgument(f"cannot connect to the dispatcher at {address!r}: {e}") from None
        raise
    return sock, monitor


def _setup_dealer(sock: zmq.Socket, address: str, curve_server_key: Optional[bytes],
                  curve_keys: Optional[tuple[bytes, bytes]]) -> zmq.Socket:
    if address.startswith("tcp://") and host_port(address[len("tcp://"):]) is None:
        # ZeroMQ takes a port past 65535, modulo 65536: a typo's client reached whatever listens there.
        raise InvalidArgument(f"cannot connect to the dispatcher at {address!r}: not tcp://HOST:PORT with a port "
                              "of 1-65535")
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, DEALER_HWM)
    sock.setsockopt(zmq.RCVHWM, DEALER_HWM)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    # Not ZMQ_IMMEDIATE: with it, a connection that breaks drops the replies it had received
    # but the client had not read yet (the last batch of a drained dispatcher). Without it a
    # request sent while the connection was down may still be delivered after the reconnect:
    # hence "UNAVAILABLE: lost the connection" means "may or may not have run", and its
    # shared memory stays reserved (docs/protocol.md).
    if curve_server_key:
        if curve_keys is None:
            curve_keys = zmq.curve_keypair()  # encryption with a throw-away identity
        sock.curve_publickey, sock.curve_secretkey = curve_keys
        sock.curve_serverkey = curve_server_key
    events = 0
    for e in _LOST:
        events |= e
    monitor = sock.get_monitor_socket(events)
    try:
        sock.connect(address)
    except BaseException:
        monitor.close(linger=0)
        raise
    return monitor


def close_connection(codec: ClientCodec, sock: zmq.Socket, monitor: zmq.Socket, ctx: Optional[zmq.Context],
                     failure: Callable[[], BaseException]) -> None:
    """Close a client's connection (Client's I/O thread and AsyncClient alike): a `cancel` for each
    generation in flight when its user closes it (``failure`` is closed_error; not after a
    failure), every request in flight failed with ``failure``, the sockets and ``ctx`` (the
    client's own, else None) closed, the pool freed."""
    cancels = codec.cancels_of_generations() if failure is closed_error else []
    for frame in cancels:
        try:
            sock.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError:  # the connection is gone or full: nothing more to tell it
            break
    codec.fail_all(failure)
    sock.disable_monitor()
    monitor.close(linger=0)
    sock.close(linger=CANCELS_LINGER_MS if cancels else 0)
    if ctx is not None:
        ctx.term()
    codec.close_pool()


def connection_lost(monitor: zmq.Socket, codec: "ClientCodec") -> str:
    """Drain the monitor: why the connection to the dispatcher is gone, or "". A handshake that
    failed on the security mechanism (a client without keys at a CURVE node) is not retried by
    ZeroMQ: the codec's ``refused`` keeps why, for the requests sent after it."""
    from zmq.utils.monitor import recv_monitor_message

    why = ""
    while True:
        try:
            event = recv_monitor_message(monitor, zmq.NOBLOCK)
        except zmq.Again:
            return why
        # A failed handshake is followed by its disconnection, which said less: a client with no
        # keys at a CURVE node was told only that the connection was lost.
        if event["event"] != zmq.EVENT_DISCONNECTED or not why:
            why = _LOST.get(event["event"], why)
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            codec.refused = why


def lost_error(address: str, why: str) -> BaseException:
    if why in _MAY_BE_CURVE and address.startswith("tcp://"):
        # Only there: given on every lost tcp connection, it sent the users of a node without
        # CURVE, whose connection broke (the node stopped, a frame over its limit), after keys.
        why += _CURVE_HINT
    return Unavailable(f"{why} ({address}) with the request in flight")


class CodecAccess:
    """What both clients expose of their codec: the pool, the specs, ``alloc_array``."""

    _codec: ClientCodec

    @property
    def address(self) -> str:
        return self._codec.address

    @property
    def shm_threshold(self) -> int:
        return self._codec.shm_threshold

    @property
    def specs(self) -> dict:
        return self._codec.specs

    @property
    def pool(self) -> ShmPool:
        return self._codec.pool

    def alloc_array(self, shape, dtype) -> np.ndarray:
        """A numpy array living in this client's shared memory. Fill it in place and pass it
        to infer(): it is sent by reference, with no copy."""
        return self._codec.alloc_array(shape, dtype)
