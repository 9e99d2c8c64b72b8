"""The vLLM side of the LLM worker (workers/llm_worker.py): engine, KV hand-off, calibration.

The KV moves between instances through vLLM's ExampleConnector (per-layer safetensors files in
a folder the node's instances share, shared/VLLM_CPU.md), subclassed here as
`BatchyardKVConnector` so that only prefill jobs store and only ``kv_from`` jobs load. The stock
connector stores every prompt it has not seen and loads whatever it finds: a generate without
``kv_from`` would not be computed from scratch, every GPU request would write its KV to disk,
and calibration prompts would land in the shared folder. It also names the stored entry after
prompt[:-1] on one side and prompt[:-2] on the other (it expects the decode prompt to be the
prefill prompt plus the first token), so prompts of k*block+1 tokens never matched.

Prefix caching is off in both engines. With it on, the connector would write a moved KV over
blocks the engine may share with running requests (it injects all of a prompt's blocks), and
RequestOutput.num_cached_tokens could not tell moved tokens from local hits; off, that count is
exactly the tokens taken from the moved KV.

Everything that needs vLLM imports it inside a function: the pure helpers are unit tested
without it, and the connector class is built on first use (module ``__getattr__``).
"""

from __future__ import annotations

import logging
import math
import os
import random
import re
import shutil
import tempfile
import time
import zlib
from pathlib import Path

import msgspec

from batchyard import protocol as P
from batchyard.llm_routing import moved_tokens

log = logging.getLogger("batchyard.worker")
KV_STALE_S = 600.0  # KV entries older than this at start belong to requests long gone
COMPLETE = "complete"  # marker the storing side writes after every layer's file is written
CONNECTOR = "BatchyardKVConnector"  # loaded by vLLM from this module (kv_connector_module_path)
STORE, LOAD = "store", "load"  # kv_transfer_params["batchyard"]: what the connector does


# ------------------------------------------------------------------ pure helpers
def kv_root(backend: str, model_name: str, kv_dir: str = "") -> Path:
    """The KV folder shared by a node's prefill and decode instances of one model: every
    worker computes the same path from the node's config."""
    if kv_dir:
        return Path(kv_dir)
    # The model's name made one path component ("x/../../home/u" led the folder, and the sweep
    # of stale entries, out of the temp dir), and one no other name makes (its hash where changed).
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", model_name).lstrip(".")
    if name != model_name:
        name = f"{name}-{zlib.crc32(model_name.encode()):08x}"
    return Path(tempfile.gettempdir()) / f"batchyard-kv-{zlib.crc32(backend.encode()):08x}-{name}"




def check_job(job: P.LlmJob, max_model_len: int, vocab: int) -> list[str]:
    """One message per request of the job: "" when it may run, else why it may not."""
    n = len(job.seqs)
    if len(job.prompts) != n or len(job.max_tokens) != n:
        why = f"job has {n} seqs, {len(job.prompts)} prompts and {len(job.max_tokens)} max_tokens; they must match"
        return [why] * n
    out = []
    for prompt, max_tokens in zip(job.prompts, job.max_tokens):
        if not prompt:
            out.append("empty prompt")
        elif max_tokens < 1:
            out.append(f"max_tokens must be >= 1, got {max_tokens}")
        elif len(prompt) > max_model_len - max_tokens:
            out.append(f"prompt of {len(prompt)} tokens + max_tokens {max_tokens} exceeds the engine's "
                       f"max_model_len {max_model_len}")
        elif not all(0 <= t < vocab for t in prompt):
            out.append(f"token ids must be in [0, {vocab})")  # out of range crashes the engine's step
        else:
            out.append("")
    return out


def sampling_kwargs(max_tokens: int, kv: str = "", eos: tuple = (), sampling: P.Sampling | None = None) -> dict:
    """SamplingParams for a job's request: token ids only, greedy unless ``sampling`` (its
    fields are SamplingParams'), max_tokens tokens, or fewer where it decodes one of ``eos``
    (the model's end-of-sequence ids; none: exactly max_tokens) or of the sampling's
    stop_token_ids. The engine runs without a tokenizer (skip_tokenizer_init), so vLLM knows no
    EOS of its own: the model's are stop tokens beside the request's, and ``ignore_eos`` stays
    set for the EOS it does not know (``masked_until_min_tokens`` has min_tokens hold them back)."""
    kw = dict(temperature=0.0, max_tokens=max_tokens, detokenize=False, ignore_eos=True)
    if sampling is not None:
        kw.update((k, v) for k, v in msgspec.structs.asdict(sampling).items() if v is not None)
    kw.pop("bad_words_token_ids", None)  # (no SamplingParams argument: set_bad_words sets it)
    stops = list(dict.fromkeys((*kw.pop("stop_token_ids", ()), *eos)))
    if stops:
        kw["stop_token_ids"] = stops
    if kv:
        kw["extra_args"] = {"kv_transfer_params": {"batchyard": kv}}
    return kw


def masked_until_min_tokens(params, eos: tuple, sampling: P.Sampling | None) -> None:
    """The model's end-of-sequence ids among the tokens vLLM's min_tokens holds back, even where
    they stop nothing (``ignore_eos``): vLLM's server masks the model's EOS under min_tokens
    whatever ignore_eos says (SamplingParams.update_from_generation_config, which with
    ignore_eos set only adds them to that set)."""
    if eos and sampling is not None and sampling.min_tokens:
        params.update_from_generation_config({"eos_token_id": list(eos)})


def set_bad_words(params, sampling: P.Sampling | None) -> None:
    """The token sequences the engine bans: where vLLM's update_from_tokenizer puts its
    tokenized ``bad_words``. The engine runs without a tokenizer, so the front door tokenizes
    them (openai_fields.bad_words_token_ids) and no SamplingParams argument takes ids."""
    if sampling is not None and sampling.bad_words_token_ids:
        params._bad_words_token_ids = [list(ids) for ids in sampling.bad_words_token_ids]


def is_kv_entry(entry: Path) -> bool:
    """Whether ``entry`` is one the connector writes: a folder named by a hash of token ids
    (kv_entry), holding layers' safetensors files, the COMPLETE marker, and the temporary file
    safetensors writes a layer's to before renaming it (one a crash mid-write left) only."""
    if not (_KV_ENTRY_NAME.fullmatch(entry.name) and entry.is_dir() and not entry.is_symlink()):
        return False
    return all((f.name == COMPLETE or f.name.endswith(".safetensors") or _WRITING.fullmatch(f.name))
               and f.is_file() and not f.is_symlink() for f in entry.iterdir())


_KV_ENTRY_NAME = re.compile(r"[0-9a-f]{32,128}")  # (vLLM's safe_hash hex digest)
_WRITING = re.compile(r"\.tmp\w{6,12}")  # (safetensors' save_file: a tempfile in the folder, renamed)


def sweep_stale(root: Path, older_than_s: float = KV_STALE_S, now: float | None = None, keep=()) -> int:
    """Remove KV entries left by requests that never came back for them (a crash, a lost job),
    none written within ``older_than_s`` (by its files' times: a prompt stored again rewrites
    them, not the folder's) and none of ``keep`` (in use here). Only the connector's entries
    (is_kv_entry): a kv_dir set to a folder of the user's had every entry older than 10 minutes
    removed, files and folders alike."""
    now = time.time() if now is None else now
    keep = {str(k) for k in keep}
    removed = 0
    for entry in root.iterdir():
        try:
            if str(entry) in keep or not is_kv_entry(entry):
                continue
            newest = max([entry.stat().st_mtime, *(f.stat().st_mtime for f in entry.iterdir())] if entry.is_dir()
                         else [entry.stat().st_mtime])
            if now - newest > older_than_s:
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
                removed += 1
        except OSError:
            pass  # another worker of the node swept it first
    return removed


def _kv_mode(params) -> str:
    extra = getattr(params, "extra_args", None) or {}
    return (extra.get("kv_transfer_params") or {}).get("batchyard", "")


# ------------------------------------------------------------------ the KV connector
def kv_entry(root, token_ids: list[int], block_size: int) -> str:
    """The folder ExampleConnector keeps a prompt's KV in: vLLM's own naming (a hash of the
    moved token ids), called rather than copied so both can never disagree."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

    class _Where:  # the only attribute the naming method reads
        _storage_path = str(root)

    ids = torch.tensor(token_ids[:moved_tokens(len(token_ids), block_size)], dtype=torch.int64)
    return ExampleConnector._generate_foldername_debug(_Where(), ids, [], create_folder=False)


def _connector_class():
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
        ExampleConnector, ExampleConnectorMetadata)

    class BatchyardKVConnector(ExampleConnector):
        """ExampleConnector that stores and loads only when the request asks (kv_transfer_params),
        loads only entries whose every layer was written, and keys loads and stores alike on
        the prompt (the stock one assumes the decode prompt is the prefill prompt + 1 token)."""

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            if _kv_mode(request.sampling_params) != LOAD:
                return 0, False
            ids = list(request.prompt_token_ids or [])
            n = moved_tokens(len(ids), self._block_size)
            if n <= num_computed_tokens:
                return 0, False
            if not os.path.exists(os.path.join(kv_entry(self._storage_path, ids, self._block_size), COMPLETE)):
                return 0, False  # nothing stored, or not every layer yet: compute from scratch
            return n - num_computed_tokens, False

        def build_connector_meta(self, scheduler_output):
            meta = ExampleConnectorMetadata()
            for new in scheduler_output.scheduled_new_reqs:
                load = new.req_id in self._requests_need_load
                store = _kv_mode(new.sampling_params) == STORE and moved_tokens(
                    len(new.prompt_token_ids or []), self._block_size) > 0  # else an empty entry
                if load or store:
                    meta.add_request(token_ids=list(new.prompt_token_ids or []), block_ids=new.block_ids[0],
                                     block_size=self._block_size, is_store=not load, mm_hashes=[])
            cached = scheduler_output.scheduled_cached_reqs
            for i, req_id in enumerate(cached.req_ids):  # resumed after preemption: load again
                request = self._requests_need_load.get(req_id)
                if request is not None and req_id in cached.resumed_req_ids:
                    meta.add_request(token_ids=list(request.prompt_token_ids or []),
                                     block_ids=cached.new_block_ids[i][0], block_size=self._block_size,
                                     is_store=False, mm_hashes=[])
            self._requests_need_load.clear()
            return meta

        def wait_for_save(self):
            # End of the forward pass: every layer of each stored prompt is on disk now.
            for req in self._get_connector_metadata().requests:
                if req.is_store and len(req.token_ids):
                    folder = self._generate_foldername_debug(req.token_ids, [], create_folder=True)
                    Path(folder, COMPLETE).touch()

    return BatchyardKVConnector


def __getattr__(name: str):
    # vLLM loads the connector as getattr(import_module(kv_connector_module_path), name); built
    # on demand so that importing this module needs no vLLM (its helpers are unit tested).
    if name == CONNECTOR:
        cls = globals()[CONNECTOR] = _connector_class()
        return cls
    raise AttributeError(name)


# ------------------------------------------------------------------ engine and calibration
def set_env(wcfg) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(wcfg.vllm.kv_cache_gib))))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # "auto" stalled 200-800 ms on shared cores
    os.environ.setdefault("OMP_NUM_THREADS", str(wcfg.threads))
    # Forced, not defaulted: the engine must live in this process to be stepped between socket
    # reads, and the connector's scheduler half must see this module's state.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def build_engine(model, vcfg, root: Path):
    from vllm import EngineArgs
    from vllm.config import KVTransferConfig
    from vllm.v1.engine.llm_engine import LLMEngine

    kv = KVTransferConfig(kv_connector=CONNECTOR, kv_connector_module_path=__name__, kv_role="kv_both",
                          kv_connector_extra_config={"shared_storage_path": str(root)})
    extra = {}
    if vcfg.role == "prefill-cpu":
        # A stored prompt must be computed whole in the step that stores it: the connector
        # saves a new request's KV in its first step, so a chunked prompt would store blocks
        # not computed yet. Unchunked, a step holds max_model_len tokens and no prompt splits.
        extra = dict(enable_chunked_prefill=False, max_num_batched_tokens=model.max_model_len)
    args = EngineArgs(model=model.path, dtype="bfloat16", max_model_len=model.max_model_len,
                      max_num_seqs=vcfg.max_num_seqs, enforce_eager=True, skip_tokenizer_init=True,
                      block_size=model.block_size, distributed_executor_backend="uni", seed=0,
                      enable_prefix_caching=False, kv_transfer_config=kv, disable_log_stats=True,
                      # waiting requests go by their arrival at the dispatcher (LlmJob.order), not here
                      scheduling_policy="priority", **extra)
    return LLMEngine.from_engine_args(args)


class Calibrator:
    """Measures the engine before it registers: prefill steps by prompt length, decode steps by
    stream count. Random prompts (seeded per worker) never recur, and what the prefill
    instance stores meanwhile is deleted after."""

    def __init__(self, engine, vocab: int, max_len: int, seed: int):
        self.engine, self.vocab, self.max_len = engine, vocab, max_len
        self.rng = random.Random(seed)
        self.n = 0
        self.prompts: list[list[int]] = []

    def _add(self, length: int, max_tokens: int, kv: str) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        ids = [self.rng.randrange(3, self.vocab) for _ in range(length)]
        self.prompts.append(ids)
        self.n += 1
        params = SamplingParams(output_kind=RequestOutputKind.DELTA, **sampling_kwargs(max_tokens, kv))
        self.engine.add_request(f"calibrate-{self.n}", TokensPrompt(prompt_token_ids=ids), params)

    def prefill(self, lengths: list[int], kv: str) -> float:
        """Seconds until every prompt of one batch has its first token."""
        for n in lengths:
            self._add(n, 1, kv)
        t0 = time.perf_counter()
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return time.perf_counter() - t0

    def decode(self, streams: int, length: int, steps: int = 8) -> float:
        """Median seconds of one decode step with ``streams`` running."""
        for _ in range(streams):
            self._add(length, steps + 1, "")
        self.engine.step()  # the prefill step
        times = []
        while self.engine.has_unfinished_requests():
            t0 = time.perf_counter()
            self.engine.step()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    def run(self, lengths: tuple[int, ...], kv: str) -> tuple[list[P.PrefillSample], list[tuple[int, float]]]:
        lengths = [min(n, self.max_len - 1) for n in lengths]
        self.prefill([lengths[0]], "")
        self.decode(1, lengths[0], 2)  # warm-up: first steps build kernels (slow)
        prefill = []
        for n in lengths:
            self.prefill([n], kv)
            prefill.append(P.PrefillSample(prompts=[n], seconds=self.prefill([n], kv)))  # the second run
        prefill.append(P.PrefillSample(prompts=[lengths[0]] * 4, seconds=self.prefill([lengths[0]] * 4, kv)))
        decode = [(s, self.decode(s, lengths[0])) for s in (1, 4)]
        return prefill, decode


def prepare_kv_dir(root: Path, default: bool) -> None:
    """Create the KV folder (0700). The default one is in the shared temp dir: another user's
    folder there could feed this engine KV, so it must be ours and closed to others."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = root.lstat()
    if default and (not root.is_dir() or root.is_symlink() or st.st_uid != os.getuid() or st.st_mode & 0o077):
        raise PermissionError(f"KV folder {root} is not a private folder of this user (uid {os.getuid()}); "
                              f"remove it or set kv_dir in [[llm_models]]")
    removed = sweep_stale(root)
    if removed:
        log.info("removed %d stale KV entries from %s", removed, root)
