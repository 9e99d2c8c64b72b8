"""The offline schedule search (bench/offline_schedule.py): the upper bound the report sets MCB
against must be a schedule the devices can run, and on a trace small enough to enumerate, the
best one."""

from __future__ import annotations

import numpy as np
import pytest

from batchyard.bench.offline_schedule import replay, search
from batchyard.bench.simulator import Device

DEVICES = [Device("gpu0", "gpu", 0.15e-3, 0.02e-3, max_batch=8),
           Device("amx0", "cpu", 0.0, 0.08e-3, max_batch=4), Device("amx1", "cpu", 0.0, 0.08e-3, max_batch=4)]


def _every_fifo_block_schedule(arr, devices) -> float:
    """The optimum over FIFO-block schedules, by enumerating them all (tiny traces only)."""
    n = len(arr)

    def best(i, free):
        if i == n:
            return 0.0
        out = np.inf
        for d, dev in enumerate(devices):
            for length in range(1, min(dev.max_batch, n - i) + 1):
                start = max(free[d], arr[i + length - 1])
                finish = start + dev.curve().predict(length)
                rest = best(i + length, free[:d] + (finish,) + free[d + 1:])
                out = min(out, rest + sum(finish - a for a in arr[i:i + length]))
        return out

    return best(0, (0.0,) * len(devices)) / n


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_beam_wide_enough_finds_the_best_fifo_block_schedule(seed):
    arr = np.cumsum(np.random.default_rng(seed).exponential(40e-6, 7))  # a burst: batching must pay
    exact = _every_fifo_block_schedule(arr, DEVICES)
    found = search(arr, DEVICES, beam=10_000, weight=0.0)
    assert found.mean_s == pytest.approx(exact, rel=1e-12)
    assert replay(arr, DEVICES, found.blocks) == pytest.approx(found.mean_s, rel=1e-12)


def test_the_schedule_found_is_one_the_devices_can_run():
    arr = np.cumsum(np.random.default_rng(5).exponential(25e-6, 400))
    found = search(arr, DEVICES, beam=8, weight=4.0)
    assert replay(arr, DEVICES, found.blocks) == pytest.approx(found.mean_s, rel=1e-9)  # replay asserts feasibility
    assert found.mean_s >= DEVICES[1].curve().predict(1) - 1e-15  # no request beats the fastest T(1)
    assert {d for _, _, d, _ in found.blocks} == {0, 1, 2}  # both kinds used


def test_requests_that_arrive_together_tie_without_breaking_the_search():
    arr = np.repeat(np.arange(6) * 1e-4, 4)  # bursts of 4 identical instants: many equal scores
    found = search(arr, DEVICES, beam=4, weight=1.0)
    assert replay(arr, DEVICES, found.blocks) == pytest.approx(found.mean_s, rel=1e-9)


def test_a_device_given_by_measured_points_may_run_its_whole_max_batch():
    # A GPU known only by measured (B, seconds) has launch_s 0: the search took it for a device
    # without a launch cost and cut its runs at 4 items, so on the measured H200 + AMX curves its
    # schedules were 100x worse than MCB's. Twelve requests at once belong in one batch.
    gpu = Device("gpu0", "gpu", 0.0, 0.0, max_batch=16, points=((1, 0.389e-3), (8, 0.471e-3), (16, 0.636e-3)))
    found = search(np.zeros(12), [gpu], beam=4, weight=1.0)
    assert [length for _, length, _, _ in found.blocks] == [12]
    assert found.mean_s == pytest.approx(gpu.curve().predict(12))


def test_merge_replaces_only_the_scenarios_run_and_keeps_the_rest(tmp_path):
    """``--merge`` passed the report's path where the report belonged: a TypeError after every
    point had been searched (minutes a point at the documented size), and nothing written."""
    import json

    from batchyard.bench import offline_schedule

    kept = {"scenario": "seeds", "load": 0.1, "requests": 200, "policies_ms": {"mcb": 1.0}, "searched_ms": 1.0,
            "offline_ms": 1.0, "mcb_over_offline": 1.0, "lower_bound_ms": 0.08}
    (tmp_path / "offline_schedule.json").write_text(json.dumps(
        {"simulated": True, "n": 200, "full": 1000, "trace_seeds": "named", "rows": [kept], "wall_s": 5.0}))
    offline_schedule.main(["--merge", "--scenarios", "1-cpu", "--requests", "200", "--full", "1000", "--jobs", "1",
                           "--out", str(tmp_path)])
    rep = json.loads((tmp_path / "offline_schedule.json").read_text())
    assert [(r["scenario"], r["load"]) for r in rep["rows"]] == [("seeds", 0.1)] + [("1-cpu", x) for x in (0.3, 0.6, 0.9)]
    assert rep["rows"][0] == kept and rep["wall_s"] > 5.0
    assert "| 1-cpu | 90% |" in (tmp_path / "offline_schedule.md").read_text()


def test_merge_checks_the_report_before_it_searches(tmp_path, monkeypatch):
    from batchyard.bench import offline_schedule

    monkeypatch.setattr(offline_schedule, "Pool", lambda *a, **k: pytest.fail("searched before the report was checked"))
    argv = ["--merge", "--scenarios", "1-cpu", "--requests", "200", "--full", "1000", "--out", str(tmp_path)]
    with pytest.raises(SystemExit, match="cannot read .*offline_schedule.json: No such file"):
        offline_schedule.main(argv)
    (tmp_path / "offline_schedule.json").write_text('{"n": 200, "full": 2000, "trace_seeds": "named", "rows": []}')
    with pytest.raises(SystemExit, match="was run with --full 2000, not 1000: cannot merge"):
        offline_schedule.main(argv)
