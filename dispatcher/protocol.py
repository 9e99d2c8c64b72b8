"""Wire protocol: typed MessagePack messages shared by clients, the dispatcher and workers.

Every message is a ZeroMQ multipart message whose first frame is a MessagePack map (the
*header*) and whose further frames are raw tensor bytes (*payload frames*). `docs/protocol.md`
is the normative description; this module is its executable form. Decoding is typed
(msgspec), so a wrong type, a missing field or an out-of-range value is rejected with a path
to the offending field (``$.inputs[0].shape[1]``) before any other code sees the message.
Nothing here is ever pickled.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Optional, Union

import msgpack
import msgspec

PROTOCOL_VERSION = 1

U64 = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]  # msgspec bounds fit int64
I64 = Annotated[int, msgspec.Meta(ge=-2**63, le=2**63 - 1)]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Dim = Annotated[int, msgspec.Meta(ge=0, le=2**31)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
# Segment names are file names under /dev/shm: no slashes, no dots at the start. Patterns end in
# \Z, not $: msgspec matches with re.search, and "$" also matches before a trailing newline
# ("gpu\n" passed the LLM route's pattern, and its KeyError answered a request twice).
SegmentName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}\Z")]
PRIORITY_HIGH, PRIORITY_NORMAL, PRIORITY_LOW = 0, 1, 2
Priority = Annotated[int, msgspec.Meta(ge=PRIORITY_HIGH, le=PRIORITY_LOW)]
PRIORITY_NAMES = ("high", "normal", "low")
# The longest timeout a client may ask for (about 31 years: "never", in practice). Above it
# timeout_us no longer fits the wire's uint64 once rounded (2**64 - 1 us rounds to 2**64), and the
# SDK's waits exceed threading.TIMEOUT_MAX.
MAX_TIMEOUT_S = 1e9


class Status(enum.IntEnum):
    """Reply status codes. Values follow gRPC's codes where the meaning is the same."""

    OK = 0
    CANCELLED = 1
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    UNKNOWN_MODEL = 5  # gRPC NOT_FOUND
    PERMISSION_DENIED = 7  # a shared-memory reference the client may not use
    OVERLOADED = 8  # gRPC RESOURCE_EXHAUSTED
    INTERNAL = 13
    UNAVAILABLE = 14


DTYPES = frozenset(
    ["bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
     "float16", "float32", "float64"]
)


# ---------------------------------------------------------------- tensors and placement
class ShmRef(msgspec.Struct, frozen=True):
    """A byte range in a POSIX shared-memory segment (``/dev/shm/<segment>``)."""

    segment: SegmentName
    offset: NonNeg
    nbytes: NonNeg


class TensorRef(msgspec.Struct, omit_defaults=True):
    """A tensor's metadata plus where its bytes are: exactly one of ``frame`` or ``shm``."""

    name: Name
    dtype: str
    shape: list[Dim]
    frame: Optional[NonNeg] = None  # index among the message's payload frames (0 = first after the header)
    shm: Optional[ShmRef] = None


class TensorSpec(msgspec.Struct, frozen=True):
    """One input or output of a model. ``shape`` is per item: the batch dimension is implied."""

    name: Name
    dtype: str
    shape: tuple[Dim, ...]


class ModelSpec(msgspec.Struct, frozen=True):
    """What a model takes and returns; sent by workers at registration, served to clients."""

    name: Name
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 64


class Timing(msgspec.Struct):
    queue_us: int
    compute_us: int
    total_us: int
    batch_size: int
    path: str  # "cpu" | "gpu"
    worker: str
    simulated: bool = False  # served by a simulated device: its timings are not real hardware
    # The dispatcher's clock (CLOCK_MONOTONIC, ns) when the request reached it, when its batch
    # went to the worker, and when the worker's answer came back: the front door's traces
    # (kserve_trace) place them beside its own. 0: not known (a dispatcher before these).
    arrival_ns: int = 0
    dispatched_ns: int = 0
    done_ns: int = 0
    compute_end_ns: int = 0  # the worker's, when its compute_us ended (protocol.BatchDone)


# ---------------------------------------------------------------- client -> dispatcher
class InferRequest(msgspec.Struct, tag="infer", tag_field="type", omit_defaults=True):
    v: int
    id: U64
    model: Name
    inputs: list[TensorRef]
    priority: Priority = PRIORITY_NORMAL
    timeout_us: NonNeg = 0  # 0: the dispatcher's default timeout
    outputs: dict[str, ShmRef] = {}  # outputs the client wants written into its shared memory


class ModelInfoRequest(msgspec.Struct, tag="model_info", tag_field="type"):
    v: int
    id: U64
    model: Name


class StatusRequest(msgspec.Struct, tag="status", tag_field="type", omit_defaults=True):
    """Dispatcher state. Held (long poll) until ``min_registrations`` worker registrations
    and ``min_departures`` workers taken out of rotation have happened, or ``wait_us`` has
    passed, so callers wait on an event rather than poll."""

    v: int
    id: U64
    min_registrations: NonNeg = 0
    wait_us: NonNeg = 0
    min_departures: NonNeg = 0
    # Only what readiness needs (workers, models, the counts): no curves, arrival rates,
    # decisions or lateness quantiles, which cost the dispatcher's thread far more to build.
    brief: bool = False


class CancelRequest(msgspec.Struct, tag="cancel", tag_field="type", omit_defaults=True):
    """Withdraw a still-queued infer request of this client (``id`` is that request's id). No
    reply of its own: the request is answered CANCELLED if it was still queued, otherwise it
    completes normally. A generation is stopped in its engine too. ``finished``: a streamed
    generation the client has what it needs of (a stop string was found): it ends now and is
    answered OK (no tokens: the client has them), served as far as it went, not cancelled."""

    v: int
    id: U64
    finished: bool = False


class ShmRegisterRequest(msgspec.Struct, tag="shm_register", tag_field="type", omit_defaults=True):
    """Ask for the right to reference ``segment`` on this connection. Two steps: without
    ``proved`` the reply carries a ``challenge``; the client writes it at offset 0 of the
    segment and sends the request again with ``proved``: the dispatcher reads it back, so only a
    process that can write the segment gets the grant (docs/protocol.md, "Trust model")."""

    v: int
    id: U64
    segment: SegmentName
    proved: bool = False


class ShmUnregisterRequest(msgspec.Struct, tag="shm_unregister", tag_field="type"):
    v: int
    id: U64
    segment: SegmentName


MAX_TOKEN_ID = 2**31 - 1
MAX_PROMPT_TOKENS = 1 << 17  # a generate request's prompt, in tokens
MAX_NEW_TOKENS = 1 << 16  # the most tokens one generate request may ask for
MAX_STOP_TOKEN_IDS = 1024  # a generation's stop_token_ids (vLLM sets no bound)
MAX_BAD_WORDS = 128  # token sequences a generation may not decode (vLLM's VLLM_MAX_NUM_BAD_WORDS default)
MAX_BAD_WORD_TOKENS = 1024  # ... each of at most this many tokens
MAX_LOGPROBS = 20  # the most likely tokens a generation's logprobs give at each position (vLLM's max_logprobs default)
# A request's logprobs entries, its prompt's and its generation's: a reply holds them all (at
# this bound, 3.7 MB of MessagePack; the client's decoder takes ~70 ms of them).
MAX_LOGPROB_ENTRIES = 1 << 18
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
# One position of a generation's logprobs, as vLLM's engine gives them: (token id, log
# probability, rank: 1 the likeliest) of the token decoded there first, then of the position's
# ``logprobs`` most likely tokens by rank, without the decoded one again.
PositionLogprobs = Annotated[list[tuple[TokenId, float, int]],
                             msgspec.Meta(min_length=1, max_length=MAX_LOGPROBS + 1)]
# On the wire a generation's logprobs are one MessagePack array of PositionLogprobs, kept whole
# (msgspec.Raw) from the worker to the client: the dispatcher relays them unread. Typed, a
# 128k-token prompt's at 21 a position (42 MB) held its loop 0.8 s; raw, copying 3.7 MB of them
# takes ~3 ms. The client reads them (decode_logprobs), checked against PositionLogprobs.
NO_LOGPROBS = msgspec.Raw(b"\x90")  # an empty array


def logprobs_raw(positions: list) -> msgspec.Raw:
    """A list of PositionLogprobs as the wire's field holds it."""
    return msgspec.Raw(msgspec.msgpack.encode(positions)) if positions else NO_LOGPROBS


_logprobs_decoder = msgspec.msgpack.Decoder(list[PositionLogprobs])


def decode_logprobs(raw: msgspec.Raw) -> list:
    """The PositionLogprobs of a wire's field (one of DecodeError where they are not)."""
    return _logprobs_decoder.decode(raw)
Route = Annotated[str, msgspec.Meta(pattern=r"^(|prefill-cpu|gpu)\Z")]


class Sampling(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """How a generation picks each token: vLLM's SamplingParams of these names, within the
    bounds vLLM checks (``repetition_penalty`` from 0.01: below, float32 logits overflow and
    every token comes out 0; ``seed`` any int64, as vLLM's server takes it: -1 is none, and
    torch seeds its generator with a negative one's 64 bits). Temperature 0 (the
    default) is greedy; ``seed`` makes a sampled generation the same each time its logits are
    (the decode instance draws every token, on either route). ``stop_token_ids``: tokens that
    end the generation as an end-of-sequence token does ("stop", that token the last);
    ``min_tokens``: none of those, nor the model's end-of-sequence tokens, is decoded before
    this many tokens (vLLM masks them), and no stop string ends the text before them.
    ``logit_bias`` adds to a token's logit (-100 to 100), ``allowed_token_ids`` keeps only those
    tokens' (vLLM checks either's ids against the model's vocabulary). ``bad_words_token_ids``:
    token sequences never decoded (the last token of each is masked after the others), vLLM's
    tokenized ``bad_words`` (openai_fields.bad_words_token_ids tokenizes them as vLLM does).
    ``logprobs`` (vLLM's, 0 to MAX_LOGPROBS): each token decoded comes with its log probability
    and those of that many most likely tokens at its position (PositionLogprobs);
    ``prompt_logprobs``: so does each of the prompt's tokens but the first (computed by the
    decode instance's own prefill: such a request takes the "gpu" route)."""

    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] = 0.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=2**31 - 1)] = 0  # 0 or -1: every token
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, msgspec.Meta(ge=0.01, le=1e6)] = 1.0
    seed: Optional[I64] = None  # (checked_sampling makes -1 None, as vLLM's SamplingParams does)
    min_tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_NEW_TOKENS)] = 0
    stop_token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_STOP_TOKEN_IDS)] = []
    logit_bias: Optional[Annotated[dict[TokenId, Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]],
                                   msgspec.Meta(max_length=MAX_PROMPT_TOKENS)]] = None
    allowed_token_ids: Optional[Annotated[list[TokenId], msgspec.Meta(min_length=1, max_length=MAX_PROMPT_TOKENS)]] = None
    bad_words_token_ids: Annotated[list[Annotated[list[TokenId], msgspec.Meta(min_length=1, max_length=MAX_BAD_WORD_TOKENS)]],
                                   msgspec.Meta(max_length=MAX_BAD_WORDS)] = []
    logprobs: Optional[Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)]] = None
    prompt_logprobs: Optional[Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)]] = None


class GenerateRequest(msgspec.Struct, tag="generate", tag_field="type", omit_defaults=True):
    """LLM mode: generation of ``max_tokens`` tokens after ``prompt`` (token ids), greedy unless
    ``sampling`` says otherwise. Token
    ids travel in the header: a prompt of 32k tokens is ~100 KB of MessagePack, no tensor path
    needed. ``route`` forces a path ("prefill-cpu" or "gpu"); empty lets the dispatcher choose.
    ``stream``: the tokens are also sent as the engine decodes them, in ``generated_tokens``
    messages, before the request's one reply (``generated``, which holds them all). The
    generation ends at the model's end-of-sequence token (that token the last), or with
    ``ignore_eos`` at ``max_tokens`` only, as vLLM's sampling parameter of that name."""

    v: int
    id: U64
    model: Name
    prompt: Annotated[list[TokenId], msgspec.Meta(min_length=1, max_length=MAX_PROMPT_TOKENS)]
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_NEW_TOKENS)] = 16
    priority: Priority = PRIORITY_NORMAL
    timeout_us: NonNeg = 0
    route: Route = ""
    stream: bool = False
    ignore_eos: bool = False
    sampling: Optional[Sampling] = None


ClientMessage = Union[InferRequest, ModelInfoRequest, StatusRequest, CancelRequest, ShmRegisterRequest,
                      ShmUnregisterRequest, GenerateRequest]


# ---------------------------------------------------------------- dispatcher -> client
class InferReply(msgspec.Struct, tag="result", tag_field="type", omit_defaults=True):
    v: int
    id: Optional[int]
    status: int
    message: str = ""
    outputs: list[TensorRef] = []
    timing: Optional[Timing] = None
    # True on an error reply sent while the request's batch was still running (its deadline
    # passed): the worker may still read its input regions and write its output regions until
    # a `release` with this id arrives. The client must not reuse that memory before then.
    in_flight: bool = False


class Release(msgspec.Struct, tag="release", tag_field="type"):
    """The batch of a request answered with ``in_flight`` has ended: its regions are free."""

    v: int
    id: int


class ModelInfoReply(msgspec.Struct, tag="model_info", tag_field="type", omit_defaults=True):
    v: int
    id: int
    status: int
    message: str = ""
    spec: Optional[ModelSpec] = None
    # The node's limit on a request's inline payload: the SDK refuses a bigger one before sending
    # it, as a frame past the node's ZeroMQ limit (max_message_bytes) is not refused but makes
    # ZeroMQ drop the connection, and every other request in flight on it. None: not said.
    max_inline_bytes: Optional[int] = None
    # The node's default_timeout_s (the deadline of a request that names none): the SDK's
    # requests without a timeout take it. None: not said (the SDK's own 30 s then).
    default_timeout_us: Optional[int] = None


class WorkerInfo(msgspec.Struct):
    name: str
    pid: int
    path: str
    models: list[str]
    inflight: int
    simulated: bool


class StatusReply(msgspec.Struct, tag="status", tag_field="type"):
    v: int
    id: int
    status: int
    registrations: int
    dispatcher_pid: int
    queued: int
    workers: list[WorkerInfo]
    models: list[str]
    policy: str = ""
    curves: dict[str, dict[str, Any]] = {}  # "model/path" -> launch_us, per_item_us, mode, samples, ...
    arrival_rate: dict[str, float] = {}  # model -> lambda(t) now, items/s
    decisions: dict[str, int] = {}  # reason -> count since start
    # trigger ("timer" | "arrival") -> {"n", "p50_us", "p99_us", "max_us"}: see lateness.py
    decision_lateness: dict[str, dict[str, Union[int, float]]] = {}  # (n: a count, an int)
    departures: int = 0  # workers taken out of rotation since the dispatcher started (cumulative)


class ShmReply(msgspec.Struct, tag="shm", tag_field="type", omit_defaults=True):
    v: int
    id: int
    status: int
    message: str = ""
    challenge: bytes = b""


class LlmTiming(msgspec.Struct, omit_defaults=True):
    """Where and how fast an LLM request ran. ``ttft_us``: arrival at the dispatcher until the
    first token existed on the instance that decodes; ``stand_in``: the "gpu" instance is a CPU
    engine standing in for a GPU (its timings are not a GPU's)."""

    ttft_us: int
    total_us: int
    route: str  # "prefill-cpu" | "gpu"
    decode_worker: str
    prefill_worker: str = ""
    kv_tokens: int = 0  # prompt tokens the decode instance took from the moved KV cache
    predicted_ttft_cpu_us: int = 0
    predicted_ttft_gpu_us: int = 0
    stand_in: bool = False


class GenerateReply(msgspec.Struct, tag="generated", tag_field="type", omit_defaults=True):
    v: int
    id: Optional[int]
    status: int
    message: str = ""
    param: str = ""  # a refusal's: the request field its engine named (LlmResult.param)
    tokens: list[int] = []
    timing: Optional[LlmTiming] = None
    finish_reason: str = ""  # "stop": it decoded an end-of-sequence token; "length": max_tokens
    logprobs: msgspec.Raw = NO_LOGPROBS  # one PositionLogprobs a token, where its sampling asked them
    prompt_logprobs: msgspec.Raw = NO_LOGPROBS  # one a prompt token but the first, where asked


class GenerateTokens(msgspec.Struct, tag="generated_tokens", tag_field="type", omit_defaults=True):
    """Tokens of a streamed generation (``GenerateRequest.stream``), as its engine decoded them:
    ``tokens`` from the generation's token ``start`` on. Not a reply: the request's reply
    (``generated``) still comes, once, with every token, the last ones included. A client that
    finds a gap (a message lost past a full queue) takes the rest from the reply."""

    v: int
    id: U64
    tokens: list[int]
    start: int = -1  # -1: not said (a dispatcher before it), so no gap can be found
    logprobs: msgspec.Raw = NO_LOGPROBS  # one PositionLogprobs a token, where its sampling asked them
    prompt_logprobs: msgspec.Raw = NO_LOGPROBS  # (the first message's) one a prompt token but the first


ReplyMessage = Union[InferReply, ModelInfoReply, StatusReply, ShmReply, Release, GenerateReply, GenerateTokens]


# ---------------------------------------------------------------- worker <-> dispatcher
class PrefillSample(msgspec.Struct, array_like=True):
    """One measured engine step that prefilled ``prompts`` (their token counts) in ``seconds``."""

    prompts: list[int]
    seconds: float


class LlmEngine(msgspec.Struct, omit_defaults=True):
    """What an LLM worker (a vLLM engine) is: sent in its Register instead of tensor models."""

    model: Name
    role: Annotated[str, msgspec.Meta(pattern=r"^(prefill-cpu|gpu)\Z")]
    stand_in: bool = False  # a CPU engine standing in for the GPU instance
    block_size: int = 0
    max_model_len: int = 0
    max_num_seqs: int = 0
    # measured at start (calibration): prefill steps and decode steps (streams, seconds)
    prefill: list[PrefillSample] = []
    decode: list[tuple[int, float]] = []


class Register(msgspec.Struct, tag="register", tag_field="type", omit_defaults=True):
    v: int
    worker: Name
    pid: int
    path: str  # "cpu" | "gpu" (a simulated worker names the device it stands in for)
    models: list[ModelSpec]
    max_inflight: Annotated[int, msgspec.Meta(ge=1)] = 1
    numa_node: int = -1
    simulated: bool = False
    llm: Optional[LlmEngine] = None
    # Drawn once per process start: tells a restart from a registration's retry where pid and
    # connection do not (pid 1 in a container, over tcp: the peer is its address alone).
    started: str = ""
    # The longest the worker may hold one batch before it answers it whatever its backend does
    # (a Triton worker's own call timeout, and a wait for a slot before it): none while 0.
    batch_bound_s: Annotated[float, msgspec.Meta(ge=0.0, le=1e6)] = 0.0


class Heartbeat(msgspec.Struct, tag="heartbeat", tag_field="type"):
    worker: Name


class ItemResult(msgspec.Struct, omit_defaults=True):
    seq: int
    status: int
    message: str = ""
    outputs: list[TensorRef] = []  # ``frame`` indices count from this item's first frame
    n_frames: int = 0


class BatchDone(msgspec.Struct, tag="batch_done", tag_field="type"):
    batch_id: int
    worker: str
    compute_us: int
    results: list[ItemResult]
    # The first batch of its size this worker process ran, a size its warm-up did not run: its
    # time includes one-time kernel builds (the first call at a new size measured 25-35 %
    # slower, once 10x): the dispatcher does not learn from it.
    first_of_size: bool = False
    # When its compute ended, on the worker's CLOCK_MONOTONIC (ns; 0: not known): the front
    # door's traces place the model's run, compute_us long, before it.
    compute_end_ns: int = 0


class Goodbye(msgspec.Struct, tag="goodbye", tag_field="type"):
    """A worker stopping cleanly: take it out of rotation now, not after the heartbeat timeout."""

    worker: Name


class Leaving(msgspec.Struct, tag="leaving", tag_field="type"):
    """A worker stopping with batches still in flight: send it no new batch; its replies and its
    goodbye follow."""

    worker: Name


class LlmResult(msgspec.Struct, omit_defaults=True):
    seq: int
    status: int
    message: str = ""
    param: str = ""  # a refusal's: the request field its engine named (vLLM's VLLMValidationError.parameter)
    tokens: list[int] = []
    first_token_s: float = 0.0  # job receipt -> this request's first token, on the worker's clock
    kv_tokens: int = 0  # prompt tokens loaded from the moved KV cache (decode jobs)
    finish_reason: str = ""  # vLLM's: "stop" (an end-of-sequence token) or "length"
    logprobs: msgspec.Raw = NO_LOGPROBS  # one PositionLogprobs a token, where its sampling asked them
    prompt_logprobs: msgspec.Raw = NO_LOGPROBS  # one a prompt token but the first, where asked


class LlmDone(msgspec.Struct, tag="llm_done", tag_field="type"):
    """A finished LLM job. ``compute_s``: receipt to last result, on the worker's clock."""

    job_id: int
    worker: str
    compute_s: float
    results: list[LlmResult]


class LlmTokens(msgspec.Struct, tag="llm_tokens", tag_field="type", omit_defaults=True):
    """Tokens a streamed generate job's request decoded in one engine step (``LlmJob.stream``),
    from its token ``start`` on; its last ones come in the job's LlmDone only."""

    job_id: int
    worker: str
    seq: int
    start: int
    tokens: list[int]
    logprobs: msgspec.Raw = NO_LOGPROBS
    prompt_logprobs: msgspec.Raw = NO_LOGPROBS  # (the first message's)


WorkerMessage = Union[Register, Heartbeat, BatchDone, Goodbye, Leaving, LlmDone, LlmTokens]


class Batch(msgspec.Struct, tag="batch", tag_field="type"):
    """One message per batch. After this header come, per request, the client's original
    header frame followed by its ``n_frames[i]`` payload frames, forwarded untouched."""

    batch_id: int
    model: str
    seqs: list[int]
    n_frames: list[int]
    # seq -> {segment: [st_dev, st_ino]}: the file each shared-memory segment of that request was
    # granted for (shm_grants.py); the worker maps no other file under that name
    files: dict[int, dict[str, tuple[int, int]]] = {}


class Registered(msgspec.Struct, tag="registered", tag_field="type"):
    worker: str


class Reregister(msgspec.Struct, tag="reregister", tag_field="type"):
    worker: str


class LeavingNoted(msgspec.Struct, tag="leaving_noted", tag_field="type"):
    """The answer to ``leaving``: every batch sent to the worker was sent before this."""

    worker: str


class Closing(msgspec.Struct, tag="closing", tag_field="type"):
    """From a dispatcher ending its drain, to each registered worker, before it exits: no answer
    to ``leaving`` will come, nor any batch. The worker is no longer registered; it registers
    again when a dispatcher asks (``reregister``, the answer to a heartbeat)."""

    worker: str


class Restart(msgspec.Struct, tag="restart", tag_field="type"):
    """To a worker's heartbeat socket: a batch of it never came back, so its model is stuck.
    The worker exits (EX_SOFTWARE) and its supervisor starts it again."""

    worker: str
    reason: str


class RegisterRejected(msgspec.Struct, tag="register_rejected", tag_field="type"):
    worker: str
    message: str


class LlmJob(msgspec.Struct, tag="llm_job", tag_field="type", omit_defaults=True):
    """Work for an LLM worker. ``kind`` "prefill": run the prompts as one step with max_tokens=1
    and store their KV for the decode instance; "generate": generate ``max_tokens[i]`` tokens
    greedily, taking the stored KV when ``kv_from`` names the prefill instance that stored it.
    The worker answers one LlmDone per job; generate jobs of one request each run concurrently
    in the engine (continuous batching)."""

    job_id: int
    kind: Annotated[str, msgspec.Meta(pattern=r"^(prefill|generate)\Z")]
    seqs: list[int]
    prompts: list[list[int]]
    max_tokens: list[int]
    kv_from: str = ""
    # Arrival order at the dispatcher, per request: the engine schedules waiting requests by it
    # (vLLM's priority policy), so a request whose KV arrived after its CPU prefill still goes
    # ahead of the prompts that reached the dispatcher after it.
    order: list[int] = []
    # generate jobs: send each step's tokens as decoded (LlmTokens), for a client that streams
    stream: bool = False
    # generate jobs: decode max_tokens past the model's end-of-sequence tokens too
    ignore_eos: bool = False
    # generate jobs: how each token is picked (None: greedy); a prefill's one token is greedy
    sampling: Optional[Sampling] = None


class LlmAbort(msgspec.Struct, tag="llm_abort", tag_field="type"):
    """Stop these requests of job ``job_id`` (their deadline passed, or their client cancelled;
    the dispatcher has answered them): the engine frees their slots and KV blocks. The job's
    LlmDone still comes, with these requests CANCELLED."""

    job_id: int
    seqs: list[int]


DispatcherToWorker = Union[Batch, Registered, Reregister, LeavingNoted, Closing, Restart, RegisterRejected,
                           LlmJob, LlmAbort]


# ---------------------------------------------------------------- codecs
_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode

client_message_decoder = msgspec.msgpack.Decoder(ClientMessage)
reply_decoder = msgspec.msgpack.Decoder(ReplyMessage)
worker_message_decoder = msgspec.msgpack.Decoder(WorkerMessage)
to_worker_decoder = msgspec.msgpack.Decoder(DispatcherToWorker)
infer_request_decoder = msgspec.msgpack.Decoder(InferRequest)

# msgspec raises UnicodeDecodeError (not a DecodeError) for a str that is not valid UTF-8.
# RecursionError: a header nested a thousand deep (in a field nobody reads) is the sender's fault.
DecodeError = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError)


SALVAGE_MAX_KEYS = 64  # top-level keys salvage_id walks (every client message has far fewer)


def salvage_id(raw: bytes) -> Optional[int]:
    """Best effort: the request id of a header that failed typed decoding, so the error
    reply can still be matched by the client. None when the header is not even a map, and for
    a cancel: its id names the request it withdraws, which gets a result of its own (answered
    under that id, a malformed cancel gave the request a second result). A map whose `type` is
    given twice may be a cancel too: read as a dict, its last `type` ("infer") hid its first
    ("cancel"). Only the top-level map is walked, its other values skipped in C: unpacked
    whole (a Python call per nested map), a malformed 5 MiB header held the dispatcher's
    thread 1.6 s."""
    types, rid = [], None
    try:
        # raw=True: a header whose strings are not valid UTF-8 still yields its id. The first
        # object only: bytes after it (two maps in one frame) made unpackb refuse the whole.
        unpacker = msgpack.Unpacker(raw=True, strict_map_key=False, max_buffer_size=max(len(raw), 1))
        unpacker.feed(raw)
        keys = unpacker.read_map_header()
        if keys > SALVAGE_MAX_KEYS:  # a header has a dozen; 2.6M tiny pairs held the thread 180 ms
            return None
        for _ in range(keys):
            key = unpacker.unpack()
            if key == b"type":
                types.append(unpacker.unpack())
            elif key == b"id":
                rid = unpacker.unpack()  # the last, as typed decoding reads a repeated key
            else:
                unpacker.skip()
    except Exception:
        # What was read before the part that could not be (a value nested 2,000 deep, after the
        # type and the id) still names the request: the reply went without its id, unmatched.
        # Only with its type read: otherwise it may be a cancel's.
        if not types:
            return None
    if len(types) > 1 or b"cancel" in types:
        return None
    if type(rid) is int and 0 <= rid < 2**63:  # not a bool: True is an int to isinstance
        return rid
    return None


def error_reply(rid: Optional[int], status: Status, message: str, in_flight: bool = False) -> bytes:
    return encode(InferReply(v=PROTOCOL_VERSION, id=rid, status=int(status), message=message, in_flight=in_flight))
