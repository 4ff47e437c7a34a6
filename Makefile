# Each target does all its own set-up in .venv inside the checkout.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
# The accelerator-specific torch build. On a CPU-only machine use a CPU wheel
# (this project's machines keep one on local disk; elsewhere add
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu). GPU users:
#   make TORCH_SPEC='torch' demo   (PyPI's default Linux build carries CUDA)
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: venv demo test test-fast lint bench clean

# What setup.py compiles with mypyc (its COMPILED, and serving/native.py): an edit rebuilds.
NATIVE_SRC := setup.py serving/native.py serving/scheduler/seq.py serving/scheduler/state.py \
	serving/scheduler/scheduler.py serving/sim/simulator.py controller/sim/decode_run.py

$(VENV)/.installed: pyproject.toml $(NATIVE_SRC)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

# The main job on its embedded default.
demo: venv
	$(VENV)/bin/slotune tune

# The whole test suite, as CI runs it (installs Prometheus and Chromium when root).
test: venv
	bash scripts/system-deps.sh
	$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# A developer's quick subset: no Ray cluster, no Prometheus server, nothing slow.
test-fast: venv
	$(PY) -m pytest -m "not slow and not ray and not prometheus" $(PYTEST_ARGS); rc=$$?; [ $$rc -eq 5 ] && exit 0; exit $$rc

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache *.egg-info build
	find serving controller -name "*.so" -delete; rm -f *.so serving/_native.json  # the simulator's mypyc build
