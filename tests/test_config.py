"""The node config: typos and bad values are refused with the file, the table and the key named,
the shipped examples load, and a written config reads back equal."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from batchyard.config import (ConfigError, DispatcherConfig, ModelConfig, NodeConfig, TensorConfig, TritonConfig,
                              WorkerConfig, _numa_nodes, _online_cpus, _ranges, load_config, parse_config, to_toml)
from batchyard.client import Client
from batchyard.deploy import asset

from conftest import BIG_MODEL, ROOT, SUM_MODEL, sim_worker

NODE = """\
[dispatcher]
frontend = "ipc:///tmp/by-test/fe"
backend = "ipc:///tmp/by-test/be"
max_queue = 100

[[models]]
name = "sum"
factory = "batchyard.workers.models:mlp"
max_batch = 16
inputs = [{ name = "x", dtype = "float32", shape = [4] }]
outputs = [{ name = "y", dtype = "float32", shape = [2] }]

[[workers]]
name = "amx0"
kind = "amx"
models = ["sum"]
cpus = [0]

[[workers]]
name = "amx1"
kind = "amx"
models = ["sum"]
cpus = [1]

[[workers]]
name = "gpu0"
kind = "triton"
models = ["sum"]
triton = { url = "127.0.0.1:8001", models = { sum = "dense" } }

[[workers]]
name = "sim0"
kind = "sim"
models = ["sum"]

[workers.sim]
launch_us = 100.0
"""


LLM = """
[[llm_models]]
name = "l"
path = "/models/l"
"""

VLLM_WORKER = """
[[workers]]
name = "v0"
kind = "vllm"
models = ["l"]

[workers.vllm]
role = "gpu"
"""


def load_error(tmp_path, text: str) -> str:
    path = tmp_path / "node.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    return str(e.value).removeprefix(str(tmp_path) + "/")


def edited(old: str, new: str, count: int = 1) -> str:
    assert old in NODE
    return NODE.replace(old, new, count)


def test_the_base_config_loads(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text(NODE)
    cfg = load_config(path)
    path.write_bytes(b"\xef\xbb\xbf" + NODE.encode())  # (a byte-order mark, as some editors write: taken)
    assert load_config(path) == cfg
    assert [w.name for w in cfg.workers] == ["amx0", "amx1", "gpu0", "sim0"]
    assert cfg.workers[3].sim.launch_us == 100.0


@pytest.mark.parametrize("text,message", [
    (edited("max_queue = 100", "max_queu = 100"),
     "node.toml: [dispatcher] unknown key 'max_queu' (did you mean 'max_queue'?)"),
    (edited("max_batch = 16", "max_bach = 16"),
     "node.toml: [[models]] #1 (name 'sum') unknown key 'max_bach' (did you mean 'max_batch'?)"),
    (edited('dtype = "float32", shape = [4]', 'dtyp = "float32", shape = [4]'),
     "node.toml: [[models]] #1 (name 'sum') unknown key 'inputs[0].dtyp' (did you mean 'inputs[0].dtype'?)"),
    (edited("cpus = [1]", "cpu = [1]"),
     "node.toml: [[workers]] #2 (name 'amx1') unknown key 'cpu' (did you mean 'cpus'?)"),
    (edited('url = "127.0.0.1:8001"', 'ur = "127.0.0.1:8001"'),
     "node.toml: [[workers]] #3 (name 'gpu0') unknown key 'triton.ur' (did you mean 'triton.url'?)"),
    (edited("launch_us = 100.0", "lanch_us = 100.0"),
     "node.toml: [[workers]] #4 (name 'sim0') unknown key 'sim.lanch_us' (did you mean 'sim.launch_us'?)"),
    # optional tables and [[llm_models]] had no suggestion (or no table named)
    (NODE + "[frontend]\ngrpc_prot = 9001\n", "node.toml: [frontend] unknown key 'grpc_prot' (did you mean 'grpc_port'?)"),
    (NODE + LLM + "blok_size = 32\n",
     "node.toml: [[llm_models]] #1 (name 'l') unknown key 'blok_size' (did you mean 'block_size'?)"),
    (NODE + LLM + VLLM_WORKER + "kv_cache_gb = 2.0\n",
     "node.toml: [[workers]] #5 (name 'v0') unknown key 'vllm.kv_cache_gb' (did you mean 'vllm.kv_cache_gib'?)"),
])
def test_a_typo_in_any_table_names_file_table_key_and_the_likely_key(tmp_path, text, message):
    assert load_error(tmp_path, text) == message


@pytest.mark.parametrize("text,message", [
    (edited('[[workers]]\nname = "amx1"', '[[workrs]]\nname = "amx1"'),
     "node.toml: unknown table [[workrs]] (did you mean [[workers]]?)"),
    (edited("[dispatcher]", "[dispatch]"), "node.toml: unknown table [dispatch] (did you mean [dispatcher]?)"),
    ("polcy = 'mcb'\n" + NODE, "node.toml: unknown key 'polcy'"),
    (NODE + '[triton]\nurl = "h:1"\n', "node.toml: unknown table [triton]: a worker's is written [workers.triton] after its [[workers]]"),
])
def test_an_unknown_top_level_table_is_refused_with_a_suggestion(tmp_path, text, message):
    assert load_error(tmp_path, text) == message


def test_a_triton_inflight_past_what_the_worker_can_hold_open_is_refused_naming_the_key(tmp_path):
    """40,000 passed, and the worker ran out of file descriptors making its slots at start: a
    traceback, exit 1 (each slot holds two open segments)."""
    got = load_error(tmp_path, edited('models = { sum = "dense" } }', 'models = { sum = "dense" }, inflight = 40000 }'))
    assert got.startswith("node.toml: ") and "inflight" in got and "<= 256" in got, got


@pytest.mark.parametrize("text,message", [
    (edited("cpus = [1]", 'cpus = ["one"]'),
     "node.toml: [[workers]] #2 (name 'amx1'): cpus[0]: expected int, got str"),
    (edited("max_queue = 100", 'max_queue = "many"'), "node.toml: [dispatcher] max_queue: expected int, got str"),
    (edited('kind = "amx"', 'kind = "amxx"'),
     "node.toml: [[workers]] #1 (name 'amx0'): kind: invalid value 'amxx' (did you mean 'amx'?)"),
    (edited('dtype = "float32"', 'dtype = "float23"'),
     "node.toml: [[models]] #1 (name 'sum'): inputs[0].dtype: invalid value 'float23' (did you mean 'float32'?)"),
    (edited("[[models]]", "[models]"), "node.toml: [models] must be an array of tables: write [[models]] for each"),
    (edited('frontend = "ipc:///tmp/by-test/fe"\n', ""), "node.toml: [dispatcher] missing required key 'frontend'"),
    # a table given as a value: "[dispatcher] : expected object, got int", "[[workers]] #1: : ..."
    ("dispatcher = 5\n" + NODE[NODE.index("[[models]]"):], "node.toml: [dispatcher]: expected table, got int"),
    ("workers = [1]\n" + NODE[:NODE.index("[[workers]]")], "node.toml: [[workers]] #1: expected table, got int"),
    # a dict's key was "[...]"
    (edited('models = { sum = "dense" }', 'models = { sum = 5 }'),
     "node.toml: [[workers]] #3 (name 'gpu0'): triton.models.sum: expected str, got int"),
    (edited('models = { sum = "dense" }', 'models = { sum = "dense" }, tensor_names = { sum = 5 }'),
     "node.toml: [[workers]] #3 (name 'gpu0'): triton.tensor_names.sum: expected table, got int"),
    (edited('models = { sum = "dense" }', 'models = { sum = "dense" }, tensor_names = { sum = { x = "IN0", y = 1 } }'),
     "node.toml: [[workers]] #3 (name 'gpu0'): triton.tensor_names.sum.y: expected str, got int"),
])
def test_a_value_of_the_wrong_type_names_the_key(tmp_path, text, message):
    assert load_error(tmp_path, text) == message


@pytest.mark.parametrize("text,message", [
    (edited("max_queue = 100", "max_queue = -5"), "node.toml: [dispatcher] max_queue: expected int >= 1, got -5"),
    (edited("cpus = [1]", "cpus = [-1]"), "node.toml: [[workers]] #2 (name 'amx1'): cpus[0]: expected int >= 0, got -1"),
    (edited("launch_us = 100.0", "launch_us = -1.0"),
     "node.toml: [[workers]] #4 (name 'sim0'): sim.launch_us: expected float >= 0.0, got -1.0"),
    (edited("max_batch = 16", "max_batch = 0"),
     "node.toml: [[models]] #1 (name 'sum'): max_batch: expected int >= 1, got 0"),
    (edited('frontend = "ipc:', 'frontend = "http:'), "node.toml: [dispatcher] frontend: expected str matching regex"),
    (edited("max_queue = 100", "default_timeout_s = 1e12"),
     "node.toml: [dispatcher] default_timeout_s: expected float <= 1000000000.0, got 1000000000000.0"),
    (edited("max_queue = 100", "max_inline_bytes = 9223372036854775807"),
     "node.toml: [dispatcher] max_inline_bytes: expected int <= 1099511627776"),
    # inf passed; per_item_us = inf then failed every request INTERNAL
    (edited("launch_us = 100.0", "launch_us = inf"),
     "node.toml: [[workers]] #4 (name 'sim0'): sim.launch_us: expected float <= 1000000000.0, got inf"),
    (edited("cpus = [1]", "cpus = [1]\nnice = 20"), "node.toml: [[workers]] #2 (name 'amx1'): nice: expected int <= 19, got 20"),
    # a lower niceness than inherited needs privilege: refused in the file, not by EPERM at start
    (edited("cpus = [1]", "cpus = [1]\nnice = -5"), "node.toml: [[workers]] #2 (name 'amx1'): nice: expected int >= 0, got -5"),
    (edited("max_queue = 100", "drain_timeout_s = inf"),
     "node.toml: [dispatcher] drain_timeout_s: expected float <= 1000000000.0, got inf"),
    # "$" let a trailing newline through
    (edited('name = "amx1"', 'name = "amx1\\n"'), "node.toml: [[workers]] #2 (name 'amx1\\n'): name: expected str matching regex"),
    # the node's own user could not connect (root could: it passed as root)
    (edited("max_queue = 100", 'ipc_mode = "000"'), "node.toml: [dispatcher] ipc_mode '000' must give the owner read and "
                                                    "write"),
    # a NUL or a newline went into logs, metric labels and the front door's paths as it was
    (edited('name = "sum"', 'name = "s\\u0000um"'), "node.toml: [[models]] #1 (name 's\\x00um'): name: expected str matching"),
    (edited('{ name = "x", dtype', '{ name = "x\\n", dtype'), "node.toml: [[models]] #1 (name 'sum'): inputs[0].name: "
                                                              "expected str matching"),
    (edited('frontend = "ipc:', 'frontend = "inproc:'), "node.toml: [dispatcher] frontend: expected str matching regex"),
    # a node of one simulated worker spun 72 % of a core; a healthy worker left rotation many times a second
    (edited("max_queue = 100", "heartbeat_interval_s = 1e-9"),
     "node.toml: [dispatcher] heartbeat_interval_s: expected float >= 0.01, got 1e-09"),
    (edited("max_queue = 100", "heartbeat_interval_s = 0.01\nworker_dead_after_s = 0.001"),
     "node.toml: [dispatcher] worker_dead_after_s: expected float >= 0.5, got 0.001"),
    (edited("max_queue = 100", "heartbeat_interval_s = 0.4\nworker_dead_after_s = 0.6"),
     "node.toml: [dispatcher] worker_dead_after_s (0.6) must be at least twice heartbeat_interval_s (0.4)"),
    # handed to C as whole milliseconds: the worker's heartbeat thread died of an OverflowError
    # (it never registered again), the front door and the Triton worker failed to start (exit 1)
    (edited("max_queue = 100", "heartbeat_interval_s = 2200000.0\nworker_dead_after_s = 5000000.0"),
     "node.toml: [dispatcher] heartbeat_interval_s: expected float <= 2147483.647, got 2200000.0"),
    (NODE + "[frontend]\nidle_timeout_s = 3e6\n",
     "node.toml: [frontend] idle_timeout_s: expected float <= 2147483.647, got 3000000.0"),
    (edited('models = { sum = "dense" } }', 'models = { sum = "dense" }, max_grpc_message_bytes = 4294967296 }'),
     "node.toml: [[workers]] #3 (name 'gpu0'): triton.max_grpc_message_bytes: expected int <= 2147483647"),
])
def test_an_out_of_range_value_names_the_key_and_the_value(tmp_path, text, message):
    assert load_error(tmp_path, text).startswith(message)


@pytest.mark.parametrize("text,message", [
    (edited('backend = "ipc:///tmp/by-test/be"', 'backend = "ipc:///tmp/by-test/fe"'),
     "node.toml: [dispatcher] frontend and backend must differ (both 'ipc:///tmp/by-test/fe')"),
    # found only at start before, each by a child's traceback
    (edited("max_queue = 100", 'ipc_group = "nosuchgroupzz"'),
     "node.toml: [dispatcher] ipc_group: no group 'nosuchgroupzz' on this host"),
    (edited("max_queue = 100", 'profile = "/nonexistent/profile.json"'),
     "node.toml: [dispatcher] profile: no file '/nonexistent/profile.json'"),
    (edited("max_queue = 100", 'curve_secret_key = "/nonexistent/server.key"\ncurve_authorized_keys = "*"'),
     "node.toml: [dispatcher] curve_secret_key: no file '/nonexistent/server.key'"),
    # a table for another kind of worker was silently ignored
    (edited("[workers.sim]\nlaunch_us", "[workers.triton]\nurl = \"localhost:8001\"\n\n[workers.sim]\nlaunch_us"),
     "node.toml: [[workers]] #4 (name 'sim0'): triton is set but kind is 'sim'; it is for kind \"triton\""),
    (edited("max_queue = 100", "breaker_backoff_s = 5.0\nbreaker_backoff_max_s = 1.0"),
     "node.toml: [dispatcher] breaker_backoff_max_s (1.0) must not be below breaker_backoff_s (5.0)"),
    # one socket in two spellings: the second bind took the first one's socket file
    (edited('backend = "ipc:///tmp/by-test/be"', 'backend = "ipc:///tmp/by-test//fe"'),
     "node.toml: [dispatcher] frontend and backend must differ (both 'ipc:///tmp/by-test/fe' and "
     "'ipc:///tmp/by-test//fe')"),
    (edited("max_queue = 100", 'policy = "gredy"'), "node.toml: [dispatcher] policy: unknown policy 'gredy'"),
    # a delay no float holds: a traceback's OverflowError, exit 1
    (edited("max_queue = 100", f'policy = "window:{"9" * 400},4"'),
     f"node.toml: [dispatcher] policy: 'window:{'9' * 400},4': expected"),
    # a size no memory holds: accepted, then every request failed in the client (a bare OverflowError)
    (edited('outputs = [{ name = "y", dtype = "float32", shape = [2] }]',
            'outputs = [{ name = "y", dtype = "float32", shape = [2147483648, 2147483648] }]'),
     "node.toml: [[models]] #1 (name 'sum'): model 'sum' output 'y': shape [2147483648, 2147483648] of float32 "
     "is 295147905179352825856 bytes a batch of max_batch 16, more than memory can hold"),
    # taken as plain mcb: a typo swallowed
    (edited("max_queue = 100", 'policy = "mcb:"'),
     "node.toml: [dispatcher] policy: 'mcb:': policy 'mcb' takes no ':' setting; write 'mcb'"),
    (edited("max_queue = 100", "heartbeat_interval_s = 15.0"),
     "node.toml: [dispatcher] worker_dead_after_s (10.0) must be at least twice heartbeat_interval_s (15.0)"),
    (edited('name = "amx1"', 'name = "amx0"'),
     "node.toml: [[workers]] #2 (name 'amx0'): name 'amx0' is already used by [[workers]] #1 (name 'amx0')"),
    (edited('models = ["sum"]\ncpus = [1]', 'models = ["summ"]\ncpus = [1]'),
     "node.toml: [[workers]] #2 (name 'amx1'): models: 'summ' is not a [[models]] name (did you mean 'sum'?)"),
    (edited("models = { sum = ", "models = { sun = "),
     "node.toml: [[workers]] #3 (name 'gpu0'): triton.models: 'sun' is not one of the models it serves ['sum'] "
     "(did you mean 'sum'?)"),
    (edited("models = { sum = \"dense\" }", "models = { sum = \"dense\" }, tensor_names = { sum = { X = \"IN0\" } }"),
     "node.toml: [[workers]] #3 (name 'gpu0'): triton.tensor_names.sum: 'X' is not one of the tensors of the "
     "model ['x', 'y'] (did you mean 'x'?)"),
    # two spec inputs on one Triton tensor: every batch failed at Triton, the worker restarted for ever
    (edited("models = { sum = \"dense\" }", "models = { sum = \"dense\" }, tensor_names = { sum = { w = \"x\" } }")
     .replace('inputs = [{ name = "x", dtype = "float32", shape = [4] }]',
              'inputs = [{ name = "x", dtype = "float32", shape = [4] }, { name = "w", dtype = "float32", shape = [4] }]'),
     "node.toml: [[workers]] #3 (name 'gpu0'): triton.tensor_names.sum: inputs 'x' and 'w' both name Triton's 'x'"),
    (edited('factory = "batchyard.workers.models:mlp"\n', ""),
     "node.toml: [[workers]] #1 (name 'amx0'): kind 'amx' builds model 'sum' itself, so that model needs factory"),
    (edited('"float32", shape = [2]', '"float32", shape = [2] }, { name = "y", dtype = "int8", shape = [1]'),
     "node.toml: [[models]] #1 (name 'sum'): model 'sum': duplicate output names ['y', 'y']"),
    # two listeners on one port: the second failed to bind after the first had started
    (edited("max_queue = 100", "metrics_port = 8000") + "[frontend]\n",
     "node.toml: [frontend] http_port and [dispatcher] metrics_port both use port 8000; give each its own"),
    (edited('frontend = "ipc:///tmp/by-test/fe"', 'frontend = "tcp://localhost:8001"') + "[frontend]\nhost = \"0.0.0.0\"\n",
     "node.toml: [frontend] grpc_port and [dispatcher] frontend both use port 8001; give each its own"),
])
def test_rules_across_fields_name_the_table(tmp_path, text, message):
    assert load_error(tmp_path, text).startswith(message)


def test_frontend_and_backend_in_one_folder_reached_through_a_symlink_are_refused(tmp_path):
    # passed, and `up` failed at the dispatcher's second bind ("served by another process")
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    text = edited('frontend = "ipc:///tmp/by-test/fe"', f'frontend = "ipc://{tmp_path}/real/sock"')
    text = text.replace('backend = "ipc:///tmp/by-test/be"', f'backend = "ipc://{tmp_path}/link/sock"')
    assert load_error(tmp_path, text).startswith("node.toml: [dispatcher] frontend and backend must differ")


def test_a_triton_only_model_needs_no_factory():
    tri = ModelConfig(name="tri", inputs=(TensorConfig("x", "float32", (8,)),),
                      outputs=(TensorConfig("y", "float32", (8,)),))
    node = NodeConfig(DispatcherConfig(frontend="ipc:///tmp/a", backend="ipc:///tmp/b"), (tri,),
                      (WorkerConfig(name="gpu0", kind="triton", models=("tri",)),
                       WorkerConfig(name="sim0", kind="sim", models=("tri",)))).validate()
    assert node.model("tri").factory == ""


def test_a_config_built_in_code_gets_the_same_range_checks():
    node = NodeConfig(DispatcherConfig(frontend="ipc:///tmp/a", backend="ipc:///tmp/b", max_queue=0),
                      (ModelConfig(name="m", inputs=(TensorConfig("x", "float32", (1,)),),
                                   outputs=(TensorConfig("y", "float32", (1,)),)),))
    with pytest.raises(ConfigError, match=r"^\[dispatcher\] max_queue: expected int >= 1, got 0$"):
        node.validate()


def test_unreadable_toml_names_the_file_and_line(tmp_path):
    assert load_error(tmp_path, NODE.replace("max_queue = 100", "max_queue = ")) == \
        "node.toml: not valid TOML: Invalid value (at line 4, column 13)"


def test_written_config_loads_back_equal(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text(NODE)
    cfg = load_config(path)
    cfg = msgspec.structs.replace(cfg, workers=cfg.workers + (
        WorkerConfig(name="gpu1", kind="triton", models=("sum",), numa_node=1, warmup_sizes=(1, 8),
                     triton=TritonConfig(url="h:1", models={"sum": "dense"}, tensor_names={"sum": {"x": "IN0"}},
                                         shm="system")),))
    path.write_text(to_toml(cfg))
    assert load_config(path) == cfg
    assert "numa_node = 1" in path.read_text() and "max_inflight" not in path.read_text()  # defaults left out


def test_parse_config_names_its_source():
    with pytest.raises(ConfigError, match=r"^demo: unknown table \[\[modles\]\] \(did you mean \[\[models\]\]\?\)$"):
        parse_config({"modles": [{}]}, source="demo")


@pytest.mark.parametrize("name", sorted(p.name for p in asset("configs").glob("*.toml")))
def test_every_shipped_example_config_loads(name):
    cfg = load_config(asset("configs", name))
    assert cfg.models and cfg.workers


def test_the_triton_example_is_shipped():
    cfg = load_config(asset("configs", "node0-triton.toml"))
    assert {w.kind for w in cfg.workers} == {"amx", "triton"}
    assert cfg.worker("gpu0").triton.models == {"minilm": "model_amx"}  # runs on a CPU host


@pytest.mark.parametrize("table", ["dispatcher", "frontend"])
def test_a_dispatcher_or_front_door_on_a_cpu_the_host_lacks_is_refused_at_start(tmp_path, table):
    path = tmp_path / "node.toml"
    text = NODE.replace("max_queue = 100", "max_queue = 100\ncpus = [4096]") if table == "dispatcher" else \
        NODE + "\n[frontend]\ngrpc_port = 9001\ncpus = [0, 4096]\n"
    path.write_text(text)
    cfg = load_config(path)
    assert (cfg.dispatcher.cpus if table == "dispatcher" else cfg.frontend.cpus)[-1] == 4096
    cfg.check_host(("amx0",))  # a worker's process does not run the dispatcher
    want = f"[{table}] cpus: cpu 4096 is not online on this host (online: {_ranges(_online_cpus())})"
    for check in (lambda: cfg.check_host(), lambda: cfg.check_host((), control=True)):
        with pytest.raises(ConfigError) as e:
            check()
        assert str(e.value) == want
    # The process itself says so and exits 78 (EX_CONFIG), before binding anything.
    r = subprocess.run([sys.executable, "-m", "batchyard.cli", table, "--config", str(path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 78 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().endswith(want), r.stderr
    assert load_error(tmp_path, text.replace("4096", "-1")).endswith(f"[{table}] cpus[{0 if table == 'dispatcher' else 1}]: "
                                                                     "expected int >= 0, got -1")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores, one kept out of the process's mask")
@pytest.mark.parametrize("table", ["dispatcher", "frontend"])
def test_a_dispatcher_or_front_door_on_a_cpu_outside_its_mask_exits_78_in_one_line(tmp_path, table):
    """Online, so the config check passes, but outside the mask it was started with (systemd's
    CPUAffinity, taskset): the process says which and exits 78 before it binds anything."""
    mine = sorted(os.sched_getaffinity(0))
    path = tmp_path / "node.toml"
    node = NODE.replace("/tmp/by-test", str(tmp_path))  # a folder its sockets could be bound in
    path.write_text(node.replace("max_queue = 100", f"max_queue = 100\ncpus = [{mine[1]}]") if table == "dispatcher"
                    else node + f"\n[frontend]\ngrpc_port = 9001\ncpus = [{mine[1]}]\n")
    r = subprocess.run(["taskset", "-c", str(mine[0]), sys.executable, "-m", "batchyard.cli", table, "--config",
                        str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 78 and "Traceback" not in r.stderr, r.stderr
    assert f"[{table}] cpus: cpus [{mine[1]}] are not available to this process (have [{mine[0]}])" in r.stderr


def test_a_worker_on_a_cpu_or_numa_node_the_host_lacks_is_refused_at_start(tmp_path):
    # A worker pinned to a cpu the host lacks died at start with a traceback, and `up` (or
    # systemd) restarted it over and over.
    path = tmp_path / "node.toml"
    path.write_text(edited("cpus = [1]", "cpus = [4096]\nnuma_node = 0"))
    cfg = load_config(path)  # a config may be written on another host: loading it does not look
    with pytest.raises(ConfigError, match=r"^\[\[workers\]\] #2 \(name 'amx1'\): cpus: cpu 4096 is not online "
                                          r"on this host \(online: 0"):
        cfg.check_host()
    cfg.check_host(("amx0",))  # a process that runs only amx0 needs only amx0's
    r = subprocess.run([sys.executable, "-m", "batchyard.cli", "up", "--config", str(path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 78 and "Traceback" not in r.stderr, r.stderr  # EX_CONFIG: not restarted
    assert r.stderr.strip().endswith("cpus: cpu 4096 is not online on this host (online: "
                                     f"{_ranges(_online_cpus())})"), r.stderr
    path.write_text(edited("cpus = [1]", "cpus = [0]\nnuma_node = 4096"))
    if _numa_nodes():
        with pytest.raises(ConfigError, match=r"numa_node: node 4096 does not exist on this host \(nodes: 0"):
            load_config(path).check_host(("amx1",))


@pytest.mark.parametrize("text,message", [
    # accepted, then: bound as port 4464 (70000 mod 65536), or a ZeroMQ error at start naming no key
    (edited('frontend = "ipc:///tmp/by-test/fe"', 'frontend = "tcp://127.0.0.1:70000"'),
     "node.toml: [dispatcher] frontend: 'tcp://127.0.0.1:70000' is not tcp://HOST:PORT with a host to connect to and "
     "a port of 1-65535"),
    # bound, but no worker or client can connect to them
    (edited('backend = "ipc:///tmp/by-test/be"', 'backend = "tcp://127.0.0.1:0"'),
     "node.toml: [dispatcher] backend: 'tcp://127.0.0.1:0' is not tcp://HOST:PORT with a host to connect to"),
    (edited('backend = "ipc:///tmp/by-test/be"', 'backend = "tcp://*:7757"'),
     "node.toml: [dispatcher] backend: 'tcp://*:7757' is not tcp://HOST:PORT with a host to connect to"),
    (edited('frontend = "ipc:///tmp/by-test/fe"', 'frontend = "tcp://127.0.0.1:*"'),
     "node.toml: [dispatcher] frontend: 'tcp://127.0.0.1:*' is not tcp://HOST:PORT with a host to connect to"),
    (edited('frontend = "ipc:///tmp/by-test/fe"', 'frontend = "tcp://127.0.0.1"'),
     "node.toml: [dispatcher] frontend: 'tcp://127.0.0.1' is not tcp://HOST:PORT"),
    (edited('backend = "ipc:///tmp/by-test/be"', 'backend = "tcp://127.0.0.1:http"'),
     "node.toml: [dispatcher] backend: 'tcp://127.0.0.1:http' is not tcp://HOST:PORT"),
    (edited('backend = "ipc:///tmp/by-test/be"', f'backend = "ipc:///tmp/{"b" * 120}"'),
     "node.toml: [dispatcher] backend: the ipc path of"),
    # no file, no permissions: another local user took a restarting worker's name (it never
    # registered again), or was served by a frontend of ipc_mode 0600
    (edited('backend = "ipc:///tmp/by-test/be"', 'backend = "ipc://@by-be"'),
     "node.toml: [dispatcher] backend: 'ipc://@by-be' is an abstract unix socket, which has no file and so no "
     "permissions: any local user could connect"),
    (edited('frontend = "ipc:///tmp/by-test/fe"', 'frontend = "ipc://@by-fe"'),
     "node.toml: [dispatcher] frontend: 'ipc://@by-fe' is an abstract unix socket"),
    # each process would find it from its own working folder (systemd's is /)
    (edited('frontend = "ipc:///tmp/by-test/fe"', 'frontend = "ipc://run/fe"'),
     "node.toml: [dispatcher] frontend: the ipc path of 'ipc://run/fe' must be absolute"),
    # taken and ignored
    (NODE + LLM + VLLM_WORKER + "\n[workers.sim]\nlaunch_us = 5.0\n",
     "node.toml: [[workers]] #5 (name 'v0'): sim is set but kind is 'vllm'; it is for kind \"sim\""),
    (edited('models = ["sum"]\ncpus = [1]', 'models = ["sum", "sum"]\ncpus = [1]'),
     "node.toml: [[workers]] #2 (name 'amx1'): models: 'sum' is listed twice"),
    (edited('models = ["sum"]\ncpus = [1]', 'models = ["sum"]\ncpus = [1]\nwarmup_sizes = [1, 32]'),
     "node.toml: [[workers]] #2 (name 'amx1'): warmup_sizes: 32 is above model 'sum''s max_batch (16)"),
])
def test_endpoints_and_worker_tables_a_typo_would_break_are_refused(tmp_path, text, message):
    assert load_error(tmp_path, text).startswith(message)


def test_a_listen_host_the_resolver_cannot_answer_for_now_is_no_config_error(tmp_path, monkeypatch):
    """A temporary resolver failure (EAI_AGAIN) made the config's check exit 78: a front door
    restarted during a DNS hiccup then stopped its node for good. Its bind fails instead (exit 1,
    started again); a name that does not exist stays a config error."""
    import socket

    from batchyard.config import _check_listen_host

    def failing(errno):
        def getaddrinfo(*a, **k):
            raise socket.gaierror(errno, "resolver says no")
        return getaddrinfo

    monkeypatch.setattr(socket, "getaddrinfo", failing(socket.EAI_AGAIN))
    _check_listen_host("[frontend] host", "node0.example")
    monkeypatch.setattr(socket, "getaddrinfo", failing(socket.EAI_NONAME))
    with pytest.raises(ConfigError, match=r"\[frontend\] host: cannot listen on 'node0.example'"):
        _check_listen_host("[frontend] host", "node0.example")


def test_hosts_and_socket_folders_the_node_needs_are_checked_at_start(tmp_path):
    """A metrics_host typo, and an ipc socket in a folder that does not exist, stopped the
    dispatcher at start with its traceback (exit 1, which systemd restarts)."""
    path = tmp_path / "node.toml"
    path.write_text(edited("max_queue = 100", 'metrics_port = 9100\nmetrics_host = "localhsot.invalid"')
                    .replace("/tmp/by-test", str(tmp_path)))
    with pytest.raises(ConfigError, match=r"\[dispatcher\] metrics_host: cannot listen on 'localhsot.invalid'"):
        load_config(path).check_host(control=True)
    path.write_text(edited('frontend = "ipc:///tmp/by-test/fe"', f'frontend = "ipc://{tmp_path}/none/fe"'))
    with pytest.raises(ConfigError, match=r"\[dispatcher\] frontend: no folder '.*/none' for the socket"):
        load_config(path).check_host(control=True)
    # A folder the socket cannot be made in (one its user may not write; /sys, where none is made
    # even by root): ZeroMQ's traceback at start, exit 1, restarted for ever.
    path.write_text(edited('frontend = "ipc:///tmp/by-test/fe"', 'frontend = "ipc:///sys/fe"')
                    .replace("/tmp/by-test", str(tmp_path)))
    with pytest.raises(ConfigError, match=r"\[dispatcher\] frontend: cannot make the socket 'ipc:///sys/fe' in "
                       r"'/sys' as uid \d+: "):
        load_config(path).check_host(control=True)
    # The front door binds none of the dispatcher's endpoints, and its unit may not write their
    # folder (ProtectSystem=strict, no RuntimeDirectory): probed there too, it exited 78.
    from batchyard.cli import load_node

    load_node(str(path), control=True, binds=False)
    # Another machine's address where the metrics server or the front door listens: each passed,
    # then failed to bind at start, exit 1 (the node restarted every 2 s for ever).
    for text, key in ((edited("max_queue = 100", 'metrics_port = 9100\nmetrics_host = "192.0.2.1"'),
                       r"\[dispatcher\] metrics_host"),
                      (NODE + '[frontend]\nhost = "192.0.2.1"\n', r"\[frontend\] host")):
        path.write_text(text.replace("/tmp/by-test", str(tmp_path)))
        with pytest.raises(ConfigError, match=key + r": cannot listen on '192.0.2.1': "):
            load_config(path).check_host(control=True)
    from batchyard.transport import write_keypair

    _, node_key = write_keypair(str(tmp_path / "keys"), "node")  # a tcp backend takes CURVE only
    for host, why in (("localhsot.invalid", "cannot listen on 'localhsot.invalid'"),
                      ("192.0.2.1", "cannot listen on '192.0.2.1'"),  # TEST-NET-1: not this host's
                      ("[::1]", "'tcp://[::1]:7757': IPv6 hosts are not supported")):
        path.write_text(edited('backend = "ipc:///tmp/by-test/be"', f'backend = "tcp://{host}:7757"\n'
                               f'curve_secret_key = "{node_key}"\ncurve_authorized_keys = "*"')
                        .replace("/tmp/by-test", str(tmp_path)))
        with pytest.raises(ConfigError, match=r"\[dispatcher\] backend: " + re.escape(why)):
            load_config(path).check_host(control=True)
    load_config(path).check_host(("amx0",))  # a worker binds nothing: its folder may come later
    load_config(path).check_host()  # nor does calibrate (every worker, its own endpoints)
    # A file where the socket goes was deleted to bind it (a typo naming the config removed it).
    victim = tmp_path / "node-notes.txt"
    victim.write_text("kept")
    path.write_text(edited('frontend = "ipc:///tmp/by-test/fe"', f'frontend = "ipc://{victim}"'))
    with pytest.raises(ConfigError, match=r"\[dispatcher\] frontend: '.*node-notes.txt' exists and is not a socket"):
        load_config(path).check_host(control=True)
    from batchyard.transport import EndpointInUse, refuse_if_served

    with pytest.raises(EndpointInUse, match="exists and is not a socket"):
        refuse_if_served(f"ipc://{victim}")
    assert victim.read_text() == "kept"
    path.write_bytes(NODE.replace("/tmp/by-test", str(tmp_path)).encode() + "# caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="node.toml: not UTF-8"):
        load_config(path)


@pytest.mark.parametrize("case", ["unknown name", "factory typo", "factory package typo", "factory no function",
                                  "factory that fails", "cpu outside the mask"])
def test_a_worker_misconfigured_exits_78_in_one_line(tmp_path, case):
    """Each was a traceback and exit 1, which neither `up` nor systemd treats as final: restarted
    for ever. (A factory that is no function, or that fails when called, a weights file missing
    say, still was until the load turned any failure but memory into one line and 78.)"""
    text, name, prefix = NODE.replace("/tmp/by-test", str(tmp_path)), "sim0", []
    if case == "unknown name":
        name, want = "sim9", "no [[workers]] entry named 'sim9'; have ['amx0', 'amx1', 'gpu0', 'sim0']"
    elif case == "factory typo":
        text, name = text.replace("models:mlp", "models:mlpp"), "amx0"
        want = "[[models]] 'sum': cannot load model factory 'batchyard.workers.models:mlpp'"
    elif case == "factory package typo":  # found by the config's host check, before any import
        text, name = text.replace("batchyard.workers.models:mlp", "batchyrd.workers.models:mlp"), "amx0"
        want = "node.toml: [[models]] 'sum': factory 'batchyrd.workers.models:mlp': no module named 'batchyrd'"
    elif case == "factory no function":
        text, name = text.replace("batchyard.workers.models:mlp", "os:sep"), "amx0"
        want = "[[models]] 'sum': cannot load model factory 'os:sep': it is a str, not a function"
    elif case == "factory that fails":
        text, name = text.replace("batchyard.workers.models:mlp", "json:loads"), "amx0"
        want = "[[models]] 'sum': model factory 'json:loads' failed: TypeError: the JSON object must be"
    else:
        mine = sorted(os.sched_getaffinity(0))
        if len(mine) < 2:
            pytest.skip("needs two cores, one kept out of the process's mask")
        text = text.replace("cpus = [0]", f"cpus = [{mine[1]}]")
        name, prefix = "amx0", ["taskset", "-c", str(mine[0])]
        want = f"[[workers]] 'amx0': cpus [{mine[1]}] are not available to this process (have [{mine[0]}])"
    path = tmp_path / "node.toml"
    path.write_text(text)
    r = subprocess.run([*prefix, sys.executable, "-m", "batchyard.cli", "worker", "--config", str(path), "--name",
                        name], capture_output=True, text=True, timeout=300)
    assert r.returncode == 78 and "Traceback" not in r.stderr and want in r.stderr, r.stderr
    if case.startswith("factory "):  # (the file too, found when the worker loads the model)
        assert f"{tmp_path}/node.toml: {want.removeprefix('node.toml: ')}" in r.stderr, r.stderr


def test_a_config_error_a_child_of_up_finds_names_the_file_up_was_given(tmp_path):
    """The children run a copy of the config in a private folder: an error only a child finds
    (a factory's function misspelt) named no file, and a check the child repeats named the copy."""
    path = tmp_path / "node.toml"
    path.write_text(NODE.replace("/tmp/by-test", str(tmp_path)).replace("models:mlp", "models:mlpp"))
    r = subprocess.run([sys.executable, "-m", "batchyard.cli", "up", "--config", str(path)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 78, r.stderr
    assert f"{path}: [[models]] 'sum': cannot load model factory 'batchyard.workers.models:mlpp'" in r.stderr, r.stderr
    assert "by-up-" not in r.stderr, r.stderr


@pytest.mark.parametrize("command", ["up", "frontend"])
def test_up_and_frontend_say_a_config_error_in_one_line_naming_the_file(tmp_path, command):
    """`up` with a factory whose package does not exist printed seven lines, none naming the file
    (the worker's failure, then up's); `frontend` on a config without [frontend] logged a line that
    named no file."""
    text = NODE.replace("/tmp/by-test", str(tmp_path))
    if command == "up":
        text = text.replace("batchyard.workers.models:mlp", "batchyrd.workers.models:mlp")
        want = "factory 'batchyrd.workers.models:mlp': no module named 'batchyrd'"
    else:
        want = "no [frontend] table: nothing for `batchyard frontend` to serve"
    path = tmp_path / "node.toml"
    path.write_text(text)
    r = subprocess.run([sys.executable, "-m", "batchyard.cli", command, "--config", str(path)], capture_output=True,
                       text=True, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 78 and len(lines) == 1 and lines[0].startswith(f"batchyard: {path}: ") and want in lines[0], \
        r.stderr


def test_a_model_factory_failing_for_a_passing_reason_exits_to_be_restarted(tmp_path):
    """A weights store down for a moment, a full /dev/shm: exit 1, which `up` and systemd restart.
    (Every failure of a load but memory's once exited 78, never restarted: the worker stayed down
    after the store came back.)"""
    path = tmp_path / "node.toml"
    path.write_text(NODE.replace("/tmp/by-test", str(tmp_path)).replace("batchyard.workers.models:mlp",
                                                                         "tests.poison_model:store_down"))
    r = subprocess.run([sys.executable, "-m", "batchyard.cli", "worker", "--config", str(path), "--name", "amx0"],
                       capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode == 1 and "ConnectionRefusedError: the weights store refused the connection" in r.stderr, \
        r.stderr[-2000:]


def test_a_log_level_typo_is_a_usage_error():
    r = subprocess.run([sys.executable, "-m", "batchyard.cli", "--log-level", "DEBG", "status", "--address",
                        "ipc:///nowhere"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "invalid choice: 'DEBG'" in r.stderr, r.stderr


@pytest.mark.parametrize("profile, message", [
    ({"models": {"sum": {"cpu": {"points": [[0, 0.01], [2, 0.02]]}}}}, "models.sum.cpu: Expected `int` >= 1 - at `$.points[0][0]`"),
    ({"models": {"sum": {"cpu": {"points": [[1, -0.01]]}}}}, "Expected `float` > 0"),
    ({"models": {"sum": {"cpu": {"points": [[1, 1e400]]}}}}, "models.sum.cpu: Number out of range"),
    # finite but huge: the fit's squares overflowed, an OverflowError traceback at load
    ({"models": {"sum": {"cpu": {"points": [[1, 1e300], [2, 2e300]]}}}},
     "models.sum.cpu: Expected `float` <= 3600.0 - at `$.points[0][1]`"),
    ({"models": {"sum": {"cpu": {"points": []}}}}, "Expected `array` of length >= 1"),
    ({"models": {"sum": {"amx": {"points": [[1, 0.01]]}}}}, "models.sum.amx: a path is \"cpu\" or \"gpu\""),
    ({"models": {"sum": {"cpu": {"points": [[1, 0.01], [1, 0.02]]}}}}, "models.sum.cpu.points: a batch size twice"),
    ({"models": {"nosuch": {"cpu": {"points": [[1, 0.01]]}}}}, "models.nosuch: not a model of this config"),
    ({"points": []}, "Object missing required field `models`"),
    # times in ms read as s: every request without a timeout of its own was refused on arrival
    ({"models": {"sum": {"cpu": {"points": [[1, 32.0], [4, 40.0]]}}}}, "models.sum: one item takes 32 s on its "
                                                                       "fastest path, past default_timeout_s (30 s)"),
])
def test_a_profile_that_would_break_the_decisions_is_refused_naming_the_key(tmp_path, profile, message):
    """Read unchecked, a point at B=0 or a negative time crashed the dispatcher's first decision
    (a crash loop under systemd), a NaN time refused every request for good, an unknown path
    or model was ignored, a missing key was a bare KeyError."""
    import json

    (tmp_path / "p.json").write_text(json.dumps(profile).replace("Infinity", "1e400"))
    got = load_error(tmp_path, edited("max_queue = 100", f'profile = "{tmp_path}/p.json"'))
    assert got.startswith(f"node.toml: [dispatcher] profile: profile {tmp_path}/p.json: ") and message in got, got


def test_a_profile_that_cannot_be_read_is_refused_naming_the_key(tmp_path):
    """A profile its user may not read (calibrated as root, mode 0600) was a PermissionError
    traceback at start, exit 1, restarted for ever. (/proc/self/mem: a file no read of which
    succeeds, for root too.)"""
    got = load_error(tmp_path, edited("max_queue = 100", 'profile = "/proc/self/mem"'))
    assert got.startswith("node.toml: [dispatcher] profile: profile /proc/self/mem: cannot read it: "), got


def test_a_profile_that_calibrate_writes_is_taken(tmp_path):
    import json

    from batchyard.cost_model import CostCurve, load_profile

    pts = [[1, 0.002], [4, 0.005]]
    (tmp_path / "p.json").write_text(json.dumps({"models": {"sum": {"gpu": {"points": pts,
                                                                          **CostCurve.from_points(pts).describe()}}}}))
    assert load_profile(str(tmp_path / "p.json"), {"sum"})[("sum", "gpu")].predict(4) == pytest.approx(0.005)


def test_curve_key_files_that_hold_no_usable_key_are_named_at_load(tmp_path):
    # A public key given as the secret one, or a stray file among the authorized keys, stopped
    # the dispatcher at start with pyzmq's traceback.
    from batchyard.transport import write_keypair

    public, secret = write_keypair(str(tmp_path / "keys"), "n0")
    auth = tmp_path / "clients"
    auth.mkdir()
    (auth / "stray.key").write_text("not a key\n")
    for key_file, authorized, message in (
            (public, "*", "curve_secret_key: .*has no secret key"),
            (secret, str(auth), "curve_authorized_keys: .*clients"),
    ):
        text = edited("max_queue = 100", f'curve_secret_key = "{key_file}"\ncurve_authorized_keys = "{authorized}"')
        assert re.match(r"node\.toml: \[dispatcher\] " + message, load_error(tmp_path, text))
    (auth / "stray.key").unlink()
    cut = tmp_path / "cut.key_secret"  # a copy that lost the key's tail
    cut.write_text(re.sub(r'(secret-key = ")([^"]{40})"', lambda m: m[1] + m[2][:30] + '"', open(secret).read()))
    text = edited("max_queue = 100", f'curve_secret_key = "{cut}"\ncurve_authorized_keys = "*"')
    assert "curve_secret_key: " in load_error(tmp_path, text) and "not 32 bytes" in load_error(tmp_path, text)
    path = tmp_path / "node.toml"
    path.write_text(edited("max_queue = 100", f'curve_secret_key = "{secret}"\ncurve_authorized_keys = "{auth}"'))
    load_config(path)


def test_a_vllm_workers_interpreter_and_model_folder_are_checked_at_start(tmp_path):
    # A missing one was Popen's FileNotFoundError traceback in `batchyard up`.
    path = tmp_path / "node.toml"
    path.write_text(NODE + LLM + VLLM_WORKER.replace('role = "gpu"', 'role = "gpu"\npython = "/nonexistent/python"'))
    with pytest.raises(ConfigError, match=r"\[\[workers\]\] #\d+ \(name 'v0'\): vllm.python: '/nonexistent/python' is "
                                          r"not an executable file"):
        load_config(path).check_host(("v0",))
    path.write_text(NODE + LLM + VLLM_WORKER.replace('role = "gpu"', f'role = "gpu"\npython = "{sys.executable}"'))
    with pytest.raises(ConfigError, match=r"\[\[llm_models\]\] 'l': path: no folder '/models/l'"):
        load_config(path).check_host(("v0",))
    path.write_text((NODE + LLM + VLLM_WORKER.replace('models = ["l"]', 'models = ["l"]\nthreads = 4'))
                    .replace("/models/l", str(tmp_path)))
    load_config(path).check_host(("v0",))  # (threads: its engine's intra-op threads, as an amx worker's)


def test_an_llm_models_sampling_defaults_are_checked_at_start_by_its_worker_and_front_door(tmp_path):
    """Its generation_config.json's sampling defaults, which /v1/completions applies: one past
    vLLM's bounds would refuse every request that left the field out."""
    folder = tmp_path / "l"
    folder.mkdir()
    (folder / "generation_config.json").write_text('{"temperature": 3.0, "top_p": 0.9}')
    path = tmp_path / "node.toml"
    # (with a [frontend], its endpoints' folder: the front door's check reads the dispatcher's too)
    text = ((NODE + LLM + VLLM_WORKER + "[frontend]\ngrpc_port = 9101\nhttp_port = 9100\n")
            .replace("/models/l", str(folder)).replace("/tmp/by-test", str(tmp_path)))
    path.write_text(text)
    words = (r"\[\[llm_models\]\] 'l': path: .*/l/generation_config.json: Expected `float` <= 2.0 - at "
             r"`\$.temperature` \(or set generation_config = \"vllm\": vLLM's own defaults\)")
    for check in (lambda: load_config(path).check_host(("v0",)),  # its worker's
                  lambda: load_config(path).check_host((), control=True, binds=False)):  # its front door's
        with pytest.raises(ConfigError, match=words):
            check()
    path.write_text(text.replace(f'path = "{folder}"', f'path = "{folder}"\ngeneration_config = "vllm"'))
    load_config(path).check_host(("v0",))  # not read: vLLM's own defaults
    # the chat template, which the front door renders, compiles
    (folder / "generation_config.json").write_text('{}')
    (folder / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(ConfigError, match=r"\[\[llm_models\]\] 'l': path: .*the model's chat template does not compile"):
        load_config(path).check_host((), control=True, binds=False)
    (folder / "chat_template.jinja").unlink()
    (folder / "generation_config.json").write_text('{"temperature": 0.6, "max_new_tokens": 0}')
    path.write_text(text)
    with pytest.raises(ConfigError, match="max_new_tokens must be a positive integer, got 0"):
        load_config(path).check_host(("v0",))


@pytest.mark.parametrize("kind, extra, message", [
    ("cuda", 'precision = "fp32"', "precision is set but kind is 'cuda'; it is for kind \"amx\"; kind 'cuda' takes "
                                   "cuda.precision"),
    ("sim", "threads = 8", "threads is set but kind is 'sim'; it is for kind \"amx\""),
    ("triton", "max_inflight = 16", "max_inflight is set but kind is 'triton'; it is for kind \"amx\" or \"sim\" or "
                                    "\"cuda\" or \"tensorrt\"; kind 'triton' takes triton.inflight"),
    # warm-up never runs on these kinds
    ("sim", "warmup_sizes = [1, 4]", "warmup_sizes is set but kind is 'sim'; it is for kind \"amx\" or \"triton\" or "
                                     "\"cuda\" or \"tensorrt\""),
    ("vllm", "warmup_sizes = [1000]", "warmup_sizes is set but kind is 'vllm'; it is for kind \"amx\""),
    # a tensorrt worker asked for bf16 built an fp16 engine; one asked for eager replay ignored it
    ("tensorrt", 'cuda = { precision = "bf16", onnx = { sum = "/m.onnx" } }',
     "cuda.precision 'bf16': a tensorrt worker builds fp16 or fp32 engines; set "
     "cuda.precision = \"fp16\" or \"fp32\" (fp16 when not set)"),
    ("tensorrt", 'cuda = { precision = "fp16", graphs = false, onnx = { sum = "/m.onnx" } }',
     "cuda.graphs is set but kind is 'tensorrt'; it is for kind \"cuda\""),
    # written at their defaults: compared with the default, they were taken and ignored
    ("triton", "max_inflight = 1", "max_inflight is set but kind is 'triton'; it is for kind \"amx\" or \"sim\" or "
                                   "\"cuda\" or \"tensorrt\"; kind 'triton' takes triton.inflight"),
    ("sim", "threads = 1", "threads is set but kind is 'sim'; it is for kind \"amx\" or \"vllm\""),
    ("amx", "cuda = { device = 0 }", "cuda is set but kind is 'amx'; it is for kind \"cuda\" or \"tensorrt\""),
    ("amx", "sim = { launch_us = 150.0 }", "sim is set but kind is 'amx'; it is for kind \"sim\""),
])
def test_a_worker_key_of_another_kind_is_refused_not_ignored(tmp_path, kind, extra, message):
    # Taken and ignored: a cuda worker asked for fp32 ran bf16, a triton worker asked for 16
    # batches in flight had 2.
    text = f'\n[[workers]]\nname = "x0"\nkind = "{kind}"\nmodels = ["sum"]\n{extra}\n'
    assert message in load_error(tmp_path, NODE + text)


def test_a_triton_url_on_the_nodes_own_port_is_refused(tmp_path):
    # The front door's gRPC port and Triton's both default to 8001: the worker talked to the
    # node itself and crashed.
    assert ("[[workers]] #3 (name 'gpu0'): triton.url '127.0.0.1:8001' is this node's own [frontend] grpc_port"
            in load_error(tmp_path, NODE + "\n[frontend]\n"))
    load_config_text = NODE + "\n[frontend]\ngrpc_port = 9001\n"
    (tmp_path / "ok.toml").write_text(load_config_text)
    load_config(tmp_path / "ok.toml")


@pytest.mark.parametrize("url, frontend, says", [
    ("127.0.0.1:73537", "", "is not HOST:PORT with a port of 1-65535"),  # gRPC wraps it to 8001
    ("127.0.0.1", "", "is not HOST:PORT with a port of 1-65535"),
    # Taken, these retried "unreachable" until the worker's start-up timeout, then exit 69 (restart me):
    ("grpc://127.0.0.1:8001", "", "is not HOST:PORT with a port of 1-65535 (no URL scheme: write HOST:PORT, or "
                                  "gRPC's dns:///HOST:PORT)"),
    ("http://127.0.0.1:8001", "", "is not HOST:PORT with a port of 1-65535 (no URL scheme"),
    (" 127.0.0.1:8001", "", "is not HOST:PORT with a port of 1-65535"),
    ("127.0.0.2:9001", 'host = "0.0.0.0"\ngrpc_port = 9001', "is this node's own [frontend] grpc_port"),
    ("dns:///localhost:9001", 'grpc_port = 9001', "is this node's own [frontend] grpc_port"),  # gRPC's own form, read
    ("localhost:9002", 'http_port = 9002', "is this node's own [frontend] http_port"),
])
def test_a_triton_url_on_the_nodes_own_port_in_any_spelling_or_past_65535_is_refused(tmp_path, url, frontend, says):
    """Each was taken: the worker talked to the node's own front door, never registered, and
    every request timed out."""
    text = NODE.replace('url = "127.0.0.1:8001"', f'url = "{url}"') + "\n[frontend]\ngrpc_port = 9001\n"
    if frontend:
        text = text.replace("grpc_port = 9001\n", frontend + "\n")
    assert says in load_error(tmp_path, text)


def test_a_triton_url_in_grpcs_dns_form_is_taken(tmp_path):
    """dns:///HOST:PORT, gRPC's own target syntax, which tritonclient passes on: refused with
    the URL schemes that no resolver finds (a "/" in the host)."""
    path = tmp_path / "node.toml"
    path.write_text(NODE.replace('url = "127.0.0.1:8001"', 'url = "dns:///127.0.0.1:9101"'))
    assert load_config(path).worker("gpu0").triton.url == "dns:///127.0.0.1:9101"


def test_a_model_no_worker_serves_is_named_at_the_dispatchers_start(tmp_path, run_dir):
    """Taken without a word: the node's readiness stayed false for good and the model's requests
    waited out their timeout. Allowed (a dispatcher alone), but said."""
    node = NodeConfig(DispatcherConfig(frontend=f"ipc://{run_dir}/fe", backend=f"ipc://{run_dir}/be"),
                      (SUM_MODEL, BIG_MODEL), (sim_worker("w0", ("sum",)),)).validate()
    assert node.unserved_models() == ["big"]
    path = tmp_path / "node.toml"
    path.write_text(to_toml(node))
    proc = subprocess.Popen([sys.executable, "-m", "batchyard.cli", "dispatcher", "--config", str(path)], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True)
    try:
        with Client(node.dispatcher.frontend) as c:
            c.status(timeout=60)  # serving: its start-up lines are written
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "model 'big' is served by none of the config's [[workers]]" in err and "'sum' is served" not in err, err


def test_a_tcp_workers_socket_without_curve_is_refused(tmp_path):
    """Without CURVE anyone who reached a tcp backend registered as a worker, was handed a
    client's tensor and answered for the model: the client took the forged answer as OK."""
    assert load_error(tmp_path, edited('backend = "ipc:///tmp/by-test/be"', 'backend = "tcp://127.0.0.1:7757"')) \
        .startswith("node.toml: [dispatcher] backend 'tcp://127.0.0.1:7757' is tcp without curve_secret_key: any "
                    "peer that reaches it could register as a worker")


@pytest.mark.parametrize("precision", ["fp16", "fp32", ""])
def test_a_tensorrt_worker_takes_the_precisions_it_builds(tmp_path, precision):
    path = tmp_path / "node.toml"
    written = f'precision = "{precision}", ' if precision else ""  # not set: fp16, as it always built
    path.write_text(NODE + f'\n[[workers]]\nname = "t0"\nkind = "tensorrt"\nmodels = ["sum"]\n'
                           f'cuda = {{ {written}onnx = {{ sum = "/m.onnx" }} }}\n')
    assert load_config(path).worker("t0").cuda.precision_for("tensorrt") == (precision or "fp16")


def test_the_test_nodes_heartbeat_settings_stay_valid(tmp_path):
    # tests/conftest.py's start_node: 0.1 s heartbeats, dead after 0.6 s
    path = tmp_path / "node.toml"
    path.write_text(edited("max_queue = 100", "heartbeat_interval_s = 0.1\nworker_dead_after_s = 0.6"))
    assert load_config(path).dispatcher.worker_dead_after_s == 0.6


def test_a_port_clash_is_found_whatever_the_hosts_spelling(tmp_path, monkeypatch):
    """"vm" resolving to 127.0.0.1 beside "127.0.0.1" passed; `up` then started the node and
    its second listener failed to bind (exit 1). A name is looked up only where ports match."""
    import socket

    lookups = []
    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kw):
        lookups.append(host)
        if host == "node-a.test":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 0))]
        if host == "gone.test":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    text = edited("max_queue = 100", 'metrics_port = 8000\nmetrics_host = "node-a.test"') + '[frontend]\nhost = "127.0.0.1"\n'
    assert load_error(tmp_path, text) == ("node.toml: [frontend] http_port and [dispatcher] metrics_port both use "
                                          "port 8000; give each its own")
    text = edited('frontend = "ipc:///tmp/by-test/fe"', 'frontend = "tcp://node-a.test:7755"').replace(
        'backend = "ipc:///tmp/by-test/be"', 'backend = "tcp://127.0.0.1:7755"')
    assert load_error(tmp_path, text) == ("node.toml: [dispatcher] frontend and backend must differ (both "
                                          "'tcp://node-a.test:7755' and 'tcp://127.0.0.1:7755')")
    path = tmp_path / "ok.toml"
    lookups.clear()
    path.write_text(edited("max_queue = 100", 'metrics_port = 9100\nmetrics_host = "node-a.test"') + "[frontend]\ngrpc_port = 9001\n")
    load_config(path)
    assert lookups == []  # no two listeners on one port: nothing to look up
    # a name that does not resolve is no clash here (`check_host` names it where it must listen)
    path.write_text(edited("max_queue = 100", 'metrics_port = 8000\nmetrics_host = "gone.test"')
                    + '[frontend]\nhost = "127.0.0.1"\ngrpc_port = 9001\n')
    load_config(path)


def test_a_profile_of_huge_times_exits_78_in_one_line(tmp_path):
    (tmp_path / "p.json").write_text('{"models": {"sum": {"gpu": {"points": [[1, 1e300], [2, 2e300]]}}}}')
    path = tmp_path / "node.toml"
    path.write_text(NODE.replace("/tmp/by-test", str(tmp_path)).replace("max_queue = 100",
                                                                        f'profile = "{tmp_path}/p.json"'))
    r = subprocess.run([sys.executable, "-m", "batchyard.cli", "dispatcher", "--config", str(path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 78 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().endswith("models.sum.gpu: Expected `float` <= 3600.0 - at `$.points[0][1]`"), r.stderr


SIM_NODE = """\
[dispatcher]
frontend = "ipc://{d}/fe"
backend = "ipc://{d}/be"

[[models]]
name = "m"
inputs = [{{ name = "x", dtype = "float32", shape = [4] }}]
outputs = [{{ name = "y", dtype = "float32", shape = [4] }}]

[[workers]]
name = "s0"
kind = "sim"
models = ["m"]
"""


def test_an_output_file_that_cannot_be_written_is_named_not_its_folder():
    """calibrate --out on an existing file it may not write said "cannot write in" its folder
    (one anyone may write in, mode 1777). (/proc/version: a file no one writes, root included.)"""
    from batchyard.cli import output_problem

    assert re.fullmatch(r"cannot write to '/proc/version': .+", output_problem("/proc/version"))


@pytest.mark.parametrize("args, message", [
    # each was a traceback; calibrate's and bench's after measuring every worker or the whole run
    (["calibrate", "--config", "{config}", "--out", "/nonexistent/p.json"],
     "batchyard calibrate: --out '/nonexistent/p.json': no folder '/nonexistent'; nothing measured"),
    (["calibrate", "--config", "{config}", "--out", "{tmp}"], "batchyard calibrate: --out '{tmp}': is a folder; nothing measured"),
    (["keygen", "--out", "/proc/x", "--name", "n"],
     "batchyard keygen: --out '/proc/x': cannot write in '/proc': No such file or directory"),
    (["bench", "--address", "ipc://{tmp}/fe", "--concurrency", "1", "--out", "/proc/x"],
     "argument --out: '/proc/x': cannot write in '/proc': No such file or directory"),
    (["bench", "--address", "ipc://{tmp}/fe", "--concurrency", "1", "--window", "-1"],
     "argument --window: a number > 0, got '-1'"),
    (["bench", "--address", "ipc://{tmp}/fe", "--concurrency", "1", "--warmup", "-1"],
     "argument --warmup: a number >= 0, got '-1'"),
    (["bench", "--address", "ipc://{tmp}/fe", "--request-rate", "nan"],
     "argument --request-rate: a number >= 0 and at most 1e+06, got 'nan'"),
    (["bench", "--address", "ipc://{tmp}/fe", "--concurrency", "1", "--window", "inf"],
     "argument --window: a number > 0, got 'inf'"),
])
def test_a_command_given_an_argument_it_cannot_use_says_which_in_one_line(tmp_path, args, message):
    config = tmp_path / "node.toml"
    config.write_text(SIM_NODE.format(d=tmp_path))
    args = [a.format(config=config, tmp=tmp_path) for a in args]
    r = subprocess.run([sys.executable, "-m", "batchyard.cli", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].endswith(message.format(tmp=tmp_path)), r.stderr
    assert "B=" not in r.stdout  # calibrate: no worker was measured first


@pytest.mark.parametrize("frontend, says", [
    ('trace_file = "trace.json"', "[frontend] trace_file 'trace.json' must be an absolute path"),
    ('trace_level = "TIMESTAMPS"', "[frontend] trace_level 'TIMESTAMPS' needs a trace_file"),
    ('trace_file = "/tmp/t.json"\ntrace_level = "TIMESTAMPS"\ntrace_rate = 0', "needs a trace_file and a trace_rate"),
    ('trace_level = "TENSORS"', "trace_level"),
    ('trace_count = -2', "trace_count"),
])
def test_a_trace_setting_the_front_door_cannot_follow_is_refused_at_start(tmp_path, frontend, says):
    """As tritonserver refuses --trace-config level= without a file; a relative file was written
    wherever the front door ran (systemd's /)."""
    assert says in load_error(tmp_path, NODE + f"\n[frontend]\ngrpc_port = 9001\n{frontend}\n")
