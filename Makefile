# The two commands of the README. Each creates its own virtualenv (.venv) on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

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

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) -m batchyard.bench.dispatch_bench

clean:
	rm -rf $(VENV) *.egg-info
