# Quick start: `make demo` (main job on a generated sample video) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU wheel for machines without a GPU; GPU users install their own torch first.
TORCH_SPEC ?= torch==2.13.0
# pip's notices (a newer pip, running as root in a container) are not this project's to show
export PIP_DISABLE_PIP_VERSION_CHECK := 1
export PIP_ROOT_USER_ACTION := ignore

.PHONY: setup demo demo-figure lint test test-serial bench-frontend clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/python -m pipeline demo --out out/demo.zarr

# the README's picture: the demo's contact sheet, regenerated only by asking for it
demo-figure: demo
	cp out/demo_contact.png docs/demo_contact.png

lint: setup
	$(BIN)/ruff check .

# one worker per core (pytest-xdist); CI runs this, and lists the 25 slowest tests. One torch thread
# per worker: N workers of N threads each on N cores (OpenMP's idle threads spin) took a training
# test 5x the CPU and wall time on 2 cores.
test: setup
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(BIN)/python -m pytest -q -n auto --dist worksteal --durations=25

# the same tests in one process, one after another (to rule out a clash between tests run side by side)
test-serial: setup
	$(BIN)/python -m pytest -q

bench-frontend: setup
	$(BIN)/python benchmarks/bench_frontend.py

clean:
	rm -rf out build *.egg-info
