# The two commands of the README. Each creates its own virtualenv (.venv) on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean llm-env test-llm onnx-model

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch==2.13.0 resolves to the CPU build on these machines; never the CUDA one.
	$(PY) -m pip install -q -e '.[cpu,test,triton,frontend,bench]'
	# The Triton python-backend stub (nvidia-pytriton) was built against numpy 1.x; it gets its own.
	$(PY) -m pip install -q --target $(VENV)/triton-stub-site 'numpy<2'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/batchyard demo

# Two pytest processes (pytest-xdist): most of a test's time is waiting on the node's processes, so
# two at once on two cores took 6 min 46 s against 12 min 57 s one at a time.
# The project's modules are compiled first: the suite starts hundreds of Python processes (nodes,
# workers, front doors, scripts), and where PYTHONDONTWRITEBYTECODE is set, as on these machines,
# each of them compiled every module of the project it imported again. (__pycache__ is git-ignored;
# a module changed since is compiled again in memory, as Python always does.)
test: $(STAMP)
	$(PY) -m compileall -q -j 0 dispatcher workers bench deploy tests
	$(PY) -m pytest -q -n 2 tests

bench: $(STAMP)
	$(PY) -m batchyard.bench.dispatch_bench

# vLLM's CPU build lives in its own virtualenv: it pins transformers < 5.20, the project venv has newer.
LLM_VENV := .venv-llm
LLM_STAMP := $(LLM_VENV)/.installed

$(LLM_STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(LLM_VENV)
	$(LLM_VENV)/bin/python -m pip install -q --upgrade pip
	# torch pinned in the same command so pip takes the local CPU wheel, not a CUDA one.
	$(LLM_VENV)/bin/python -m pip install -q -e '.[llm,test]' 'torch==2.13.0'
	# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break transformers' Llama loading;
	# text models need none of them.
	$(LLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(LLM_STAMP)

llm-env: $(LLM_STAMP)

# The node runs from .venv (the project's), its vLLM workers from .venv-llm: both are needed.
test-llm: $(STAMP) $(LLM_STAMP)
	$(LLM_VENV)/bin/python -m pytest -q -m llm tests/test_llm_kv.py tests/test_llm_node.py tests/test_openai_lax.py

# The ONNX file of deploy/triton/gpu/model_gpu (docs/gpu.md): the exporter's packages (torch's
# default exporter needs onnxscript; none of the other extras brings them), then the export.
onnx-model: $(STAMP)
	$(PY) -m pip install -q -e '.[onnx]'
	$(PY) deploy/triton/gpu/export_onnx.py

clean:
	rm -rf $(VENV) *.egg-info
