"""ModelInfer's request and answer on the wire, with the tensors' raw bytes kept out of protobuf.

Through protobuf's messages, 4 MiB in and out cost the front door ~20 ms of CPU a request over
gRPC against ~2 ms over HTTP (py-spy): the input was copied into the parsed message and again
into a bytes object when read; the output by ``tobytes``, into the message, by the size check
(upb's ByteSize encodes the whole message) and by SerializeToString, with fresh pages each time.
Here protobuf parses and encodes everything else, and the raw contents are views of the bytes
gRPC received, or written once into the bytes it sends: protobuf reads a message's fields in any
order, and a repeated field's values in the order they come.
"""

from __future__ import annotations

from tritonclient.grpc import service_pb2

# Past this many fields at the request's top level (one per input's raw contents, parameter,
# input, output...), it is parsed by protobuf alone: a request of millions of tiny fields would
# hold the loop in the scan below.
MAX_SCANNED_FIELDS = 1024
# Below this size a request is parsed by protobuf alone: its copies cost less than the scan in
# Python (1.6 against 4.3 us for a [1, 16] float32 input).
SCAN_FROM_BYTES = 64 << 10
_RAW_INPUT = service_pb2.ModelInferRequest.DESCRIPTOR.fields_by_name["raw_input_contents"].number

# Wire tags (field number << 3 | 2, length-delimited): ModelInferResponse.raw_output_contents,
# ModelStreamInferResponse.infer_response.
_RAW_OUTPUT = bytes([service_pb2.ModelInferResponse.DESCRIPTOR.fields_by_name["raw_output_contents"].number << 3 | 2])
_STREAM_RESPONSE = bytes([service_pb2.ModelStreamInferResponse.DESCRIPTOR.fields_by_name["infer_response"].number << 3
                          | 2])


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


class InferRequest:
    """A ModelInferRequest whose ``raw_input_contents`` are views of the bytes received (the
    message, parsed without them, answers everything else)."""

    __slots__ = ("message", "raw_input_contents")

    def __init__(self, message, raw_input_contents: list):
        self.message, self.raw_input_contents = message, raw_input_contents

    def __getattr__(self, name: str):
        return getattr(self.message, name)


def _split_raw_inputs(data: bytes):
    """(the request's other fields' encoding, its raw_input_contents as views), or None where the
    scan stops short (a malformed request, or too many fields): protobuf then parses it whole,
    and says what is wrong in its own words."""
    view, raw, rest = memoryview(data), [], []
    i, n = 0, len(data)
    for _ in range(MAX_SCANNED_FIELDS):
        if i >= n:
            return b"".join(rest), raw
        start = i
        key, i = _read_varint(data, i)
        if i - start > 5 or key >> 32:  # protobuf refuses a tag past 32 bits or 5 bytes
            return None
        kind = key & 7
        if kind == 2:
            length, i = _read_varint(data, i)
            end = i + length
        elif kind == 0:
            _, end = _read_varint(data, i)
        elif kind in (1, 5):
            end = i + (8 if kind == 1 else 4)
        else:  # groups (3, 4): none in this message
            return None
        if end > n or i > n:
            return None
        if key >> 3 == _RAW_INPUT and kind == 2:
            raw.append(view[i:end])
        else:
            rest.append(view[start:end])
        i = end
    return None


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    """The varint at ``data[i:]`` and the index after it; past the end: (0, len(data) + 1)."""
    value = shift = 0
    while i < len(data) and shift < 70:
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7
    return 0, len(data) + 1


def parse_infer_request(data: bytes):
    """ModelInfer's and ModelStreamInfer's request deserializer."""
    split = _split_raw_inputs(data) if len(data) >= SCAN_FROM_BYTES else None
    if split is None:
        return service_pb2.ModelInferRequest.FromString(data)
    rest, raw = split
    message = service_pb2.ModelInferRequest.FromString(rest)
    return InferRequest(message, raw) if raw else message


class InferAnswer:
    """``head`` (a ModelInferResponse without raw_output_contents) and the raw contents of its
    outputs, in order (``b""`` for one written to a shared-memory region). ``stream``: sent on
    ModelStreamInfer, inside a ModelStreamInferResponse."""

    __slots__ = ("head", "raw", "stream")

    def __init__(self, head, raw: list, stream: bool = False):
        self.head, self.raw, self.stream = head, raw, stream

    def nbytes(self) -> int:
        """The encoded size, without encoding the outputs' bytes."""
        inner = self.head.ByteSize() + sum(len(_RAW_OUTPUT) + len(_varint(len(d))) + len(d) for d in self.raw)
        return inner + (len(_STREAM_RESPONSE) + len(_varint(inner)) if self.stream else 0)

    def serialize(self) -> bytes:
        parts = [self.head.SerializeToString()]
        for data in self.raw:
            parts += (_RAW_OUTPUT, _varint(len(data)), data)
        if self.stream:
            parts[:0] = (_STREAM_RESPONSE, _varint(sum(map(len, parts))))
        return b"".join(parts)


def serialize_answer(answer) -> bytes:
    """ModelInfer's and ModelStreamInfer's response serializer: an InferAnswer, or a plain
    message (a stream's error answer, a ModelStreamInferResponse)."""
    return answer.serialize() if type(answer) is InferAnswer else answer.SerializeToString()
