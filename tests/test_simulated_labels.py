"""Timings of a simulated device are labelled "simulated" (DESIGN.md) wherever they leave the node:
the learned curves of `status`, /metrics (without touching the Triton families' label sets) and
the profile `batchyard calibrate` writes."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import pytest

from batchyard.bench.harness import exposition_samples, scrape
from batchyard.config import DispatcherConfig, NodeConfig
from batchyard.cost_model import CostCurve, load_profile

from conftest import SUM_MODEL, free_port, sim_worker

TRITON_LABELS = {"model", "path", "priority", "version", "reason", "status"}  # all the nv_inference_* have


def _gauge(samples, name: str, **labels) -> float:
    (value,) = [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    return value


def test_a_simulated_nodes_curves_and_metrics_say_simulated_and_tritons_labels_stay(start_node):
    port = free_port()
    node = start_node([sim_worker(models=("sum",))], models=(SUM_MODEL,), metrics_port=port)
    with node.client() as c:
        for _ in range(3):
            assert c.infer("sum", {"x": np.ones((1, 4), np.float32)}).timing.simulated
        st = c.status()
    assert st.curves["sum/gpu"]["simulated"] is True  # before: no mark beside launch_us, samples, ...
    m = scrape(f"http://127.0.0.1:{port}/metrics")
    assert _gauge(m, "batchyard_path_simulated", model="sum", path="gpu") == 1
    # Triton dashboards key on these label sets: the mark is a family of its own, not a label
    assert all(set(s.labels) <= TRITON_LABELS for s in m if s.name.startswith("nv_inference_"))


def test_a_path_is_simulated_when_a_simulated_worker_serves_it_or_its_profile_says_so(bare_dispatcher):
    from batchyard import status_report
    from batchyard.state import WorkerState

    profile = {("p", "gpu"): CostCurve.from_points([(1, 0.001), (4, 0.002)], simulated=True)}
    d = bare_dispatcher(profile=profile)
    now = time.monotonic()
    d.core.add_worker(WorkerState(name="sim", path="gpu", models={"m": 8}, simulated=True), now)
    d.core.add_worker(WorkerState(name="amx", path="cpu", models={"m": 8, "both": 8}), now)
    d.core.add_worker(WorkerState(name="sim-cpu", path="cpu", models={"both": 8}, simulated=True), now)
    for key in (("m", "gpu"), ("m", "cpu"), ("both", "cpu")):
        d.state.cost(*key)  # a curve each, as the first batch on the path makes it
    curves = status_report.status_reply(d, 1).curves
    # real hardware only: false; a simulated worker, alone or beside a real one, or a profile
    # measured on one (no worker yet): true
    assert {k: curves[k]["simulated"] for k in ("m/gpu", "m/cpu", "both/cpu", "p/gpu")} == {
        "m/gpu": True, "m/cpu": False, "both/cpu": True, "p/gpu": True}
    m = exposition_samples(d.render_metrics())
    assert {(s.labels["model"], s.labels["path"]): s.value for s in m if s.name == "batchyard_path_simulated"} == {
        ("m", "gpu"): 1, ("m", "cpu"): 0, ("both", "cpu"): 1, ("p", "gpu"): 1}


def test_calibrate_marks_what_it_measured_on_a_simulated_worker_and_a_node_loading_it_warns(run_dir, bare_dispatcher,
                                                                                            caplog):
    from batchyard.workers.calibrate import calibrate

    node = NodeConfig(DispatcherConfig(frontend=f"ipc://{run_dir}/fe", backend=f"ipc://{run_dir}/be"), (SUM_MODEL,),
                      (sim_worker("s0", ("sum",)),)).validate()
    out = Path(run_dir) / "profile.json"
    calibrate(node, out, sizes=[1, 4], reps=1, log=lambda *_: None)
    assert json.loads(out.read_text())["models"]["sum"]["gpu"]["simulated"] is True
    curves = load_profile(str(out), {"sum"})
    assert curves[("sum", "gpu")].simulated
    with caplog.at_level(logging.WARNING, logger="batchyard.dispatcher"):
        bare_dispatcher(profile=curves)
    assert any("sum/gpu" in r.getMessage() and "simulated" in r.getMessage() for r in caplog.records), caplog.text


def test_a_profile_without_the_mark_loads_as_real_hardware_and_a_bad_mark_is_named(tmp_path, bare_dispatcher, caplog):
    old = tmp_path / "old.json"  # as calibrate wrote it before the mark
    old.write_text(json.dumps({"models": {"sum": {"cpu": {"points": [[1, 0.001], [4, 0.002]], "mode": "linear"}}}}))
    curves = load_profile(str(old), {"sum"})
    assert not curves[("sum", "cpu")].simulated
    with caplog.at_level(logging.WARNING, logger="batchyard.dispatcher"):
        bare_dispatcher(profile=curves)
    assert "simulated" not in caplog.text
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"models": {"sum": {"cpu": {"points": [[1, 0.001]], "simulated": "yes"}}}}))
    with pytest.raises(ValueError, match=r"models\.sum\.cpu.*simulated"):
        load_profile(str(bad), {"sum"})
