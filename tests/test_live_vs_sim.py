"""bench/live_vs_sim.py: the live node and the simulator get the same trace and the same curves,
and a tiny live run (all workers simulated) answers every request."""

from __future__ import annotations

import numpy as np
import pytest

from batchyard.bench import live_vs_sim as lvs
from batchyard.bench.harness import PATH, SENT, SIMULATED, STATUS, schedule
from batchyard.cost_model import load_profile


def test_the_simulator_gets_exactly_the_arrivals_the_harness_sends():
    spec = lvs.load_spec(rate=40.0, duration=3.0, seed=3)
    trace = lvs.trace_for(spec)
    sent_schedule = schedule(spec)[0]
    assert len(trace) > 80
    np.testing.assert_array_equal(trace.arrivals, sent_schedule)
    assert np.all(trace.priority == 1) and np.all(np.isinf(trace.timeout))


def test_the_profile_holds_the_simulators_curves(tmp_path):
    devices = lvs.scaled_devices(500.0)
    prof = tmp_path / "p.json"
    import json

    prof.write_text(json.dumps(lvs.profile_for(devices)))
    curves = load_profile(str(prof))  # what the live dispatcher starts from
    assert set(curves) == {("m", "gpu"), ("m", "cpu")}
    for d in devices:
        for b in (1, 3, 17, 64):
            assert abs(curves[("m", d.path)].predict(b) - d.curve().predict(b)) < 1e-9


def test_another_scenarios_curves_are_scaled_and_measured_points_refused():
    devices = lvs.scaled_devices(1000.0, "cpu-launch")  # CPUs at 0.02 + 0.06 ms*B, x1000
    cpu = [d for d in devices if d.path == "cpu"]
    assert len(cpu) == 2 and all(abs(d.launch_s - 0.02) < 1e-12 and abs(d.per_item_s - 0.06) < 1e-12 for d in cpu)
    with pytest.raises(SystemExit, match="measured points"):  # its curves cannot be scaled as launch + per item
        lvs.scaled_devices(1000.0, "h200-amx")


def test_a_tiny_live_run_answers_every_request_in_trace_order():
    devices = lvs.scaled_devices(100.0)  # CPU 8 ms an item, GPU 15 ms + 2 ms*B
    spec = lvs.load_spec(rate=0.2 * lvs.gpu_capacity(devices), duration=1.5, seed=4)
    trace = lvs.trace_for(spec)
    rows = lvs.live_rows("mcb", devices, spec)
    assert len(rows) == len(trace) and np.all(rows[:, STATUS] == 0)
    assert np.all(rows[:, SIMULATED] == 1) and set(rows[:, PATH]) <= {1.0, 2.0}
    live, sim = lvs.live_summary(rows, trace), lvs.sim_summary("mcb", trace, devices)
    assert sim["served"] == live["served"] == len(trace)  # how close the latencies are is the bench's job
    # The live arrivals are the trace's: request i went out at trace instant i, give or take the
    # client's timer (median only: a shared box can stall a send now and then).
    assert float(np.median(np.abs(rows[:, SENT] - trace.arrivals))) < 0.05
