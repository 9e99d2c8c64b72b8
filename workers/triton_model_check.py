"""Does a Triton model's config fit a Batchyard model spec? Checked once, when the GPU worker
loads, so a mismatch stops the worker at start with the exact field instead of failing every
batch later. Pure: takes the config protobuf Triton returned (``get_model_config``).

Refusals (the worker cannot serve the model): a missing tensor, a required Triton input the spec
does not feed, a different dtype, a fixed
dimension that differs from the spec, a ``max_batch_size`` below Batchyard's ``max_batch``, or a
non-batching model (``max_batch_size: 0``) whose first dimension is fixed.

A batching model's tensor with a ``reshape`` fits a spec whose per-item shape is either its
``dims`` or its ``reshape``. In the second case the tensor travels in ``dims``' shape, the only
one Triton takes on the wire ("Expected [-1,1], got [3]" for a scalar item sent as [3]), and
comes back in it: ``wire_dims`` says which tensors, and their fixed ``dims``. Triton's own idiom
for one value an item is ``dims: [1] reshape: { shape: [] }``.

Warnings (it works, but worse): ``dynamic_batching`` on, which re-batches our batches and adds
Triton's own queue delay (seed 000, pitfall 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batchyard.protocol import ModelSpec

TRITON_DTYPE = {"bool": "BOOL", "uint8": "UINT8", "int8": "INT8", "uint16": "UINT16", "int16": "INT16",
                "uint32": "UINT32", "int32": "INT32", "uint64": "UINT64", "int64": "INT64",
                "float16": "FP16", "float32": "FP32", "float64": "FP64"}


@dataclass
class ConfigCheck:
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # spec tensor name -> the per-item shape Triton takes and returns (its dims, the spec's is its reshape)
    wire_dims: dict[str, tuple[int, ...]] = field(default_factory=dict)


def fits(dims: list[int], shape: tuple[int, ...]) -> bool:
    """Triton's ``dims`` (-1: any size) take a per-item ``shape``."""
    return len(dims) == len(shape) and all(d == -1 or d == s for d, s in zip(dims, shape))


def check_model_config(cfg, spec: ModelSpec, tensor_names: dict[str, str] | None = None) -> ConfigCheck:
    """``tensor_names`` maps spec tensor names to Triton's where they differ (e.g. INPUT__0)."""
    from tritonclient.grpc import model_config_pb2 as mc

    names = tensor_names or {}
    out = ConfigCheck()
    where = f"Triton model {cfg.name!r}"
    if cfg.HasField("dynamic_batching"):
        out.warnings.append(f"{where} has dynamic_batching on: it will re-batch Batchyard's batches and add "
                            f"its own queue delay. Remove the dynamic_batching block from its config.pbtxt.")
    batching = cfg.max_batch_size > 0
    if batching and cfg.max_batch_size < spec.max_batch:
        out.problems.append(f"{where} has max_batch_size {cfg.max_batch_size} < Batchyard's max_batch "
                            f"{spec.max_batch} for {spec.name!r}")
    for kind, ours, theirs in (("input", spec.inputs, cfg.input), ("output", spec.outputs, cfg.output)):
        by_name = {t.name: t for t in theirs}
        for t in ours:
            tname = names.get(t.name, t.name)
            tt = by_name.get(tname)
            if tt is None:
                out.problems.append(f"{where} lacks {kind} {tname!r} of spec {spec.name!r} "
                                    f"(it has {sorted(by_name)})")
                continue
            want = "TYPE_" + TRITON_DTYPE.get(t.dtype, t.dtype.upper())
            got = mc.DataType.Name(tt.data_type)
            if got != want:
                out.problems.append(f"{where} {kind} {tname!r} is {got}, spec {spec.name!r} says {t.dtype} ({want})")
            dims = list(tt.dims)
            if not batching:  # the batch dimension is part of dims and must be variable
                if not dims or dims[0] != -1:
                    out.problems.append(f"{where} has max_batch_size 0 and {kind} {tname!r} dims {dims}: "
                                        f"the first dimension must be -1 to take Batchyard's batches")
                    continue
                dims = dims[1:]
            if fits(dims, t.shape):
                continue
            reshape = list(tt.reshape.shape) if batching and tt.HasField("reshape") else None
            if reshape is not None and fits(reshape, t.shape):
                if -1 not in dims:
                    out.wire_dims[t.name] = tuple(dims)
                    continue
                # The size of a -1 on the wire would follow from the item's: not done.
                out.problems.append(f"{where} {kind} {tname!r} has reshape {reshape} as spec {spec.name!r}'s "
                                    f"per-item shape, but dims {dims} with a variable dimension; give the "
                                    f"spec the dims' shape, or fix the dims")
                continue
            also = f" and reshape {reshape}" if reshape is not None else ""
            out.problems.append(f"{where} {kind} {tname!r} has dims {dims}{also}, spec {spec.name!r} has "
                                f"per-item shape {list(t.shape)}")
    mapped = {names.get(t.name, t.name) for t in spec.inputs}
    for tt in cfg.input:
        # An input Triton needs that no spec tensor feeds: every batch failed INVALID_ARGUMENT
        # ("missing required input(s)") after the check had passed.
        if tt.name not in mapped and not tt.optional:
            out.problems.append(f"{where} needs input {tt.name!r}, which spec {spec.name!r} does not have (its "
                                f"inputs: {sorted(mapped)}); map a spec input to it with triton.tensor_names, or "
                                f"mark it optional in Triton's config")
    return out
