"""LLM routing rule: where a request's prefill runs, from cost curves in tokens. Pure, no I/O.

Two options per request (issue 13):

- ``"prefill-cpu"``: prefill on the CPU instance (the AMX path), move the KV cache to the GPU
  instance, decode there. The first token the user sees comes from the GPU instance, one step
  after the KV has arrived (it recomputes the partial last block and samples).
- ``"gpu"``: prefill and decode on the GPU instance. A GPU prefill shares the engine step with
  the running decodes, so every running stream waits for it: that stall is the decode-side
  interference, charged (optionally) as extra time for each running stream.

The rule predicts each option's TTFT from the curves and the paths' current backlog and takes
the cheaper one. The simulator (bench/llm_sim.py) and a live dispatcher share this code.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFILL_CPU = "prefill-cpu"
GPU = "gpu"


@dataclass(frozen=True)
class PrefillCurve:
    """Prefill time of one engine step holding ``tokens`` prompt tokens: a + b·t + c·t²."""

    a_s: float
    b_s_per_token: float
    c_s_per_token2: float = 0.0  # attention's quadratic share; small at these lengths

    def time(self, tokens: int) -> float:
        return self.batch_time((tokens,))

    def per_prompt(self, tokens: int) -> float:
        """What one prompt adds to a step: attention's quadratic term is per sequence."""
        return self.b_s_per_token * tokens + self.c_s_per_token2 * tokens * tokens

    def batch_time(self, prompt_tokens) -> float:
        lengths = [n for n in prompt_tokens if n > 0]
        return self.a_s + sum(self.per_prompt(n) for n in lengths) if lengths else 0.0


@dataclass(frozen=True)
class DecodeCurve:
    """Time of one decode step over ``streams`` running sequences: a + b·streams."""

    a_s: float
    b_s_per_stream: float

    def step(self, streams: int) -> float:
        return 0.0 if streams <= 0 else self.a_s + self.b_s_per_stream * streams


@dataclass(frozen=True)
class KvLink:
    """Moving a prompt's KV cache from the CPU instance to the GPU instance."""

    bytes_per_token: float
    bandwidth_Bps: float
    latency_s: float = 0.0

    def transfer_s(self, tokens: int) -> float:
        return self.latency_s + self.bytes_per_token * tokens / self.bandwidth_Bps


@dataclass(frozen=True)
class LlmCurves:
    cpu_prefill: PrefillCurve
    gpu_prefill: PrefillCurve
    gpu_decode: DecodeCurve
    kv: KvLink


@dataclass(frozen=True)
class PathLoad:
    """What the router sees of the two instances at decision time (seconds are from now)."""

    cpu_backlog_s: float = 0.0  # until the CPU instance could start this prefill
    gpu_backlog_s: float = 0.0  # until the GPU instance could start this prefill
    gpu_running: int = 0  # decode streams running on the GPU instance


@dataclass(frozen=True)
class RouteChoice:
    path: str
    ttft_cpu_s: float  # predicted TTFT via prefill-cpu
    ttft_gpu_s: float  # predicted TTFT via gpu
    stall_gpu_s: float  # decode time the gpu option takes from the running streams, summed


def predict_ttft_cpu(tokens: int, load: PathLoad, curves: LlmCurves) -> float:
    # After the KV lands the request queues on the GPU instance like any other (vLLM's waiting
    # queue is FIFO): it starts no earlier than the prefills already waiting there, then one step
    # that also decodes the others. Measured live, leaving that wait out under-predicted this
    # path's TTFT by 1.6x (median, bench/llm_live_vs_sim.py).
    join_step = curves.gpu_decode.step(load.gpu_running + 1)
    ready = load.cpu_backlog_s + curves.cpu_prefill.time(tokens) + curves.kv.transfer_s(tokens)
    return max(ready, load.gpu_backlog_s) + join_step


def predict_ttft_gpu(tokens: int, load: PathLoad, curves: LlmCurves) -> float:
    # the prefill rides in one step with the running decodes
    return load.gpu_backlog_s + curves.gpu_prefill.time(tokens) + curves.gpu_decode.step(load.gpu_running)


def moved_tokens(n_prompt: int, block_size: int) -> int:
    """Prompt tokens whose KV moves: whole blocks only, and never the last token (the decode
    engine must compute at least one to get the first token's logits)."""
    return max(0, (n_prompt - 1) // block_size * block_size)


def choose_route(tokens: int, load: PathLoad, curves: LlmCurves, interference_weight: float = 0.0,
                 block_size: int = 0) -> RouteChoice:
    """The option with the earlier predicted TTFT; with ``interference_weight`` > 0 the gpu option
    is also charged ``weight × running streams × its prefill time`` (each running stream waits).
    With ``block_size``, a prompt of which no whole block would move goes to the GPU: prefilled
    on the CPU, its KV stayed there and the GPU computed the whole prompt again."""
    ttft_cpu = predict_ttft_cpu(tokens, load, curves)
    ttft_gpu = predict_ttft_gpu(tokens, load, curves)
    stall = load.gpu_running * curves.gpu_prefill.time(tokens)
    # ties go to the GPU: it is the path that needs no KV move
    path = PREFILL_CPU if ttft_cpu < ttft_gpu + interference_weight * stall else GPU
    if block_size and not moved_tokens(tokens, block_size):
        path = GPU
    return RouteChoice(path, ttft_cpu, ttft_gpu, stall)


def crossover_tokens(load: PathLoad, curves: LlmCurves, interference_weight: float = 0.0, max_tokens: int = 1 << 16) -> int:
    """The shortest prompt that goes to the GPU under ``load`` (``max_tokens`` + 1 if none does):
    prompts below it go to the CPU. Assumes the CPU's cost grows faster in tokens than the GPU's,
    so the choice flips once; found by bisection on the same rule."""
    if choose_route(1, load, curves, interference_weight).path == GPU:
        return 1
    if choose_route(max_tokens, load, curves, interference_weight).path == PREFILL_CPU:
        return max_tokens + 1
    lo, hi = 1, max_tokens  # lo -> cpu, hi -> gpu
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if choose_route(mid, load, curves, interference_weight).path == GPU:
            hi = mid
        else:
            lo = mid
    return hi


def backlog_s(rest_s: float, queued_prompts, prefill: PrefillCurve, decode_step_s: float, token_budget: int) -> float:
    """Until a prefill queued now on an engine could start: the rest of the step in progress,
    then the prompts queued ahead of it in steps of at most ``token_budget`` tokens, each step
    also decoding the engine's running streams (``decode_step_s``). The simulator's engines and
    the live dispatcher's view of its workers both use this."""
    queued = list(queued_prompts)
    if not queued:
        return rest_s
    steps = max(1, -(-sum(queued) // token_budget))
    work = sum(prefill.per_prompt(n) for n in queued) + steps * prefill.a_s
    return rest_s + work + steps * decode_step_s


def take_prefill_batch(queued_tokens: list[int], curve: PrefillCurve, token_budget: int) -> int:
    """How many queued prompts (FIFO) go into the next prefill step, by marginal cost on tokens.

    The first always goes. The next prompt, of n tokens, joins while the step stays within
    ``token_budget`` and joining pays: it delays the k prompts already in the step by its own
    per-prompt time, and it spares a step's fixed cost to itself and to every prompt queued
    behind it (each would otherwise start one fixed cost later).
    """
    if not queued_tokens:
        return 0
    taken, total = 1, queued_tokens[0]
    for i, n in enumerate(queued_tokens[1:], start=1):
        if total + n > token_budget:
            break
        delay_to_others = taken * curve.per_prompt(n)
        spared = curve.a_s * (len(queued_tokens) - i)
        if delay_to_others >= spared:
            break
        taken, total = taken + 1, total + n
    return taken
