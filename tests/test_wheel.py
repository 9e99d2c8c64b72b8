"""The wheel, installed alone into a fresh virtualenv outside the source tree, is complete:
one top-level package, its run-time assets, and a working `batchyard demo`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _source_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return [f for f in out if (ROOT / f).is_file()]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv python, its site-packages): the wheel installed with --no-deps; the dependencies
    come from the project's venv through a .pth line, so nothing is downloaded."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for f in _source_files():  # build from a copy: the checkout gets no build/ or egg-info
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    dist = tmp / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(dist), str(src)], check=True, capture_output=True)
    (wheel,) = dist.glob("batchyard-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    before = set(os.listdir(site))
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True)
    added = set(os.listdir(site)) - before
    (site / "zz_batchyard_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return py, site, added


def test_only_batchyard_lands_at_the_top_of_site_packages(installed):
    _, _, added = installed
    assert {a for a in added if not a.endswith(".dist-info")} == {"batchyard"}


def test_the_installed_package_carries_its_assets_and_is_used(installed, tmp_path):
    py, site, _ = installed
    code = ("import batchyard, batchyard.workers, batchyard.bench; from batchyard.deploy import asset; "
            "print(batchyard.__file__); "
            "print(all(asset(*p).is_file() for p in [('triton','cpu','model_amx','config.pbtxt'), "
            "('triton','cpu','model_amx','1','model.py'), ('configs','node0.toml'), "
            "('systemd','batchyard-node@.service')]))")
    out = subprocess.run([str(py), "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    where, assets = out.split()
    assert where.startswith(str(site)), where  # not the checkout
    assert assets == "True"


def test_batchyard_demo_runs_from_the_installed_wheel(installed, tmp_path):
    py, _, _ = installed
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([str(py.parent / "batchyard"), "--log-level", "WARNING", "demo", "--duration", "2",
                        "--rate", "20"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Batchyard demo" in r.stdout and "p99" in r.stdout, r.stdout


def _imports(path: Path) -> set[str]:
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_imports_run_one_way_bench_then_workers_then_core():
    for f in (ROOT / "dispatcher").glob("*.py"):
        bad = {m for m in _imports(f) if m.startswith(("batchyard.bench", "batchyard.workers", "bench", "workers"))}
        assert not bad, f"{f.name} imports {bad}"
    for f in (ROOT / "workers").glob("*.py"):
        bad = {m for m in _imports(f) if m.startswith(("batchyard.bench", "bench", "dispatcher"))}
        assert not bad, f"{f.name} imports {bad}"


def test_the_command_line_imports_no_subcommand_module_before_parsing():
    code = ("import sys; from batchyard.cli import build_parser; build_parser(); "
            "print(sorted(m for m in sys.modules if m.startswith(('torch', 'batchyard.bench.harness', "
            "'batchyard.workers.main', 'batchyard.server', 'batchyard.dispatcher_main'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
