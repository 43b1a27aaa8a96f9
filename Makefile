# Two commands on a fresh machine: `make demo` and `make test`. Both set up .venv first if needed.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
CSRC    := $(wildcard torchneuron/csrc/*.cpp torchneuron/csrc/*.h)
STAMP   := $(VENV)/.torchneuron-installed
export MAX_JOBS ?= 2

.PHONY: venv build demo test test-fast bench lint clean

venv: $(STAMP)

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip setuptools wheel ninja

# torch first (the CPU wheel), then the project: its C++ core builds here, at install time.
$(STAMP): $(VPY) pyproject.toml setup.py $(CSRC)
	$(VPY) -m pip install -q "torch==2.13.0"
	$(VPY) -m pip install -q --no-build-isolation -e ".[test]"
	touch $(STAMP)

build: venv
	$(VPY) setup.py -q build_ext --inplace

demo: venv
	$(VPY) -m torchneuron.demo

# The asynchronous device's semantics, run again in two more legs: every kernel at its launch
# (TORCHNEURON_LAUNCH_BLOCKING=1: errors at the op itself), and every kernel queued with each replayed fusion plan
# rebuilt and compared (--queue-everything --verify-replay).
ASYNC_LEGS := tests/test_async_errors.py tests/test_async_fuzz.py tests/test_eager_fusion.py tests/test_foreach.py \
              tests/test_training.py

test: venv lint
	$(VPY) -m pytest -q -rs $(PYTEST_ARGS)
	TORCHNEURON_LAUNCH_BLOCKING=1 $(VPY) -m pytest -q -m "not needs_async" $(ASYNC_LEGS)
	$(VPY) -m pytest -q -rs --queue-everything --verify-replay $(ASYNC_LEGS)

test-fast: venv
	$(VPY) -m pytest -q -x -m "not slow" $(PYTEST_ARGS)

bench: venv
	$(VPY) -m benchmarks.run $(BENCH_ARGS)

# Python: ruff; the C++ core: clang-format's layout (.clang-format) and cpplint (torchneuron/csrc/CPPLINT.cfg).
lint: venv
	$(VPY) -m ruff check torchneuron torch_neuronx tests benchmarks
	$(VENV)/bin/clang-format --dry-run --Werror $(CSRC)
	$(VENV)/bin/cpplint --quiet $(CSRC)

clean:
	rm -rf build *.egg-info torchneuron/*.so $(VENV)
