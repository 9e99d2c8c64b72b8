"""The LLM routing rule (dispatcher/llm_routing.py) and the LLM simulator: pure, no vLLM."""

import pytest

from batchyard.llm_routing import (
    GPU,
    PREFILL_CPU,
    DecodeCurve,
    KvLink,
    LlmCurves,
    PathLoad,
    PrefillCurve,
    choose_route,
    crossover_tokens,
    take_prefill_batch,
)

# A CPU that is slow per token but starts at once, a GPU that is fast per token: the shape the
# issue's rule is about (numbers chosen for round crossovers, not measured).
CURVES = LlmCurves(
    cpu_prefill=PrefillCurve(a_s=0.002, b_s_per_token=1e-4),
    gpu_prefill=PrefillCurve(a_s=0.005, b_s_per_token=1e-5),
    gpu_decode=DecodeCurve(a_s=0.004, b_s_per_stream=1e-5),
    kv=KvLink(bytes_per_token=1000, bandwidth_Bps=1e9),
)


def test_idle_gpu_takes_every_prompt():
    # idle, the CPU path still ends with a GPU step after the KV move: it cannot beat a GPU prefill
    assert crossover_tokens(PathLoad(), CURVES) == 1
    assert choose_route(10, PathLoad(), CURVES).path == GPU


def test_short_prompts_go_to_cpu_when_gpu_is_busy_long_ones_stay_on_gpu():
    busy = PathLoad(gpu_backlog_s=0.050, gpu_running=64)
    assert choose_route(64, busy, CURVES).path == PREFILL_CPU
    assert choose_route(4000, busy, CURVES).path == GPU


def test_choice_flips_at_the_crossover_the_curves_imply():
    load = PathLoad(gpu_backlog_s=0.020)
    # TTFT_cpu - TTFT_gpu = 2ms + 1.01e-4 n + step(1) - (20ms + 5ms + 1e-5 n) -> zero at n = (23ms - step(1)) / 9.1e-5
    step1 = CURVES.gpu_decode.step(1)
    expected = (0.023 - step1) / (1.01e-4 - 1e-5)
    x = crossover_tokens(load, CURVES)
    assert x == pytest.approx(expected, abs=1)
    assert choose_route(x - 1, load, CURVES).path == PREFILL_CPU
    assert choose_route(x, load, CURVES).path == GPU


def test_queueing_moves_the_crossover():
    base = crossover_tokens(PathLoad(gpu_backlog_s=0.020), CURVES)
    more_gpu_queue = crossover_tokens(PathLoad(gpu_backlog_s=0.100), CURVES)
    cpu_queue_too = crossover_tokens(PathLoad(cpu_backlog_s=0.010, gpu_backlog_s=0.020), CURVES)
    assert more_gpu_queue > base > cpu_queue_too > 1
    # a CPU backlog longer than anything the GPU could gain sends everything to the GPU
    assert crossover_tokens(PathLoad(cpu_backlog_s=10.0, gpu_backlog_s=0.020), CURVES) == 1


def test_interference_penalty_sends_more_prompts_to_cpu_when_decodes_run():
    load = PathLoad(gpu_backlog_s=0.020, gpu_running=200)
    assert crossover_tokens(load, CURVES, interference_weight=1.0) > crossover_tokens(load, CURVES)
    # with nothing decoding there is nothing to stall: the penalty changes nothing
    assert crossover_tokens(PathLoad(), CURVES, 1.0) == crossover_tokens(PathLoad(), CURVES)


def test_prefill_batch_fills_while_the_fixed_cost_saved_outweighs_the_delay():
    gpu = CURVES.gpu_prefill  # 5 ms fixed, 0.01 ms/token: cheap to add tokens -> batch up to the budget
    assert take_prefill_batch([10] * 10, gpu, token_budget=8192) == 10
    assert take_prefill_batch([10] * 10, gpu, token_budget=45) == 4
    # the last of many 100-token prompts spares only its own fixed cost (5 ms) and would delay 9 others by 1 ms each
    assert take_prefill_batch([100] * 10, gpu, token_budget=8192) == 9
    cpu = PrefillCurve(a_s=0.001, b_s_per_token=1e-3)  # per-token cost dwarfs the fixed one -> alone
    assert take_prefill_batch([200, 200, 200], cpu, token_budget=8192) == 1
    assert take_prefill_batch([], gpu, 8192) == 0


def test_simulated_routing_beats_gpu_only_near_gpu_saturation():
    from batchyard.bench.llm_sim import scenarios, simulate

    sc = scenarios()["h100-8b-56core"]
    routed = simulate(sc, "routed", 60, n=1500, seed=1)
    gpu_only = simulate(sc, "gpu-only", 60, n=1500, seed=1)
    assert 0 < routed["cpu_share"] < 0.5
    assert routed["ttft_p50_ms"] < gpu_only["ttft_p50_ms"]
    # far below saturation the GPU wins every prompt and routing changes nothing
    assert simulate(sc, "routed", 5, n=200, seed=3)["cpu_share"] == 0


def test_a_sample_that_is_no_time_does_not_break_the_fit():
    """A calibration sample of 5e-324 s: its weight 1/y overflowed, every refit raised, and
    each job whose completion refitted left its requests stranded."""
    import numpy as np

    from batchyard.llm_fit import LinearFit

    fit = LinearFit(2, (0.001, 0.0001))
    fit.add((1.0, 32.0), 5e-324, calibration=True, source="w")
    fit.add((1.0, float("nan")), 0.01, calibration=True, source="w")
    for n in (32, 64, 128, 256, 512):
        fit.add((1.0, float(n)), 0.002 + 0.0001 * n)
    assert np.isfinite(fit.coef).all()
    assert fit.predict((1.0, 300.0)) == pytest.approx(0.032, rel=0.05)
