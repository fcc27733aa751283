# Two commands do all the set-up on a fresh machine:  make demo  and  make test.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
MPIEXEC := $(VENV)/bin/mpiexec
TORCH  := $(VENV)/.torch-installed
DEMO_SETUP := $(VENV)/.ddl_triton-demo-installed
TEST_SETUP := $(VENV)/.ddl_triton-test-installed
RANKS  ?= 4
# Every editable install of a package-dir layout makes setuptools print a 10-line notice ("Editable
# installation ... be careful with folders in your working directory with the same name as your
# package"): here that folder is the package itself, so there is nothing to act on, and it is filtered.
PIP_E  := PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install --quiet -e

.PHONY: setup demo test check bench clean

# Everything the suite needs, without running it (make test's set-up).
setup: $(TEST_SETUP)

# CPU torch first, pinned: an unpinned torch would pull a multi-GB CUDA build.
$(TORCH):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	touch $@

# make demo's set-up: the project and the demo extra (MPICH, scikit-learn), nothing else.
$(DEMO_SETUP): pyproject.toml $(TORCH)
	$(PIP_E) ".[demo]"
	touch $@

# make test's set-up: the test extra, which holds the demo's, so it serves make demo too.
$(TEST_SETUP): pyproject.toml $(TORCH)
	$(PIP_E) ".[test]"
	touch $@ $(DEMO_SETUP)

# tests/multirank/test_demo.py runs these two commands at a reduced size, so a broken demo cannot land.
demo: $(DEMO_SETUP)
	$(VENV)/bin/ddlrun -n $(RANKS) -- $(PY) examples/demo.py
	$(VENV)/bin/ddlrun -n $(RANKS) -- $(PY) examples/train_cnn.py --hook int8

# Bytecode first: the environment may set PYTHONDONTWRITEBYTECODE, and then every rank process
# the suite starts would compile ddl_triton from source again (about 0.1 s of CPU each, measured).
test: $(TEST_SETUP)
	$(PY) -m compileall -q ddl_triton transports schedules tests bench examples > /dev/null
	$(PY) -m pytest -q

# The inner loop (about 2 minutes on 2 cores): the fast tier without its slowest tests (marked slow)
# and the exact default suite on one reused rank world per size (1-4 ranks). make test runs everything.
check: $(TEST_SETUP)
	$(PY) -m compileall -q ddl_triton transports schedules tests > /dev/null
	$(PY) -m pytest -q -m "not slow" tests/unit "tests/multirank/test_multirank.py::test_exact_default_dispatch"

bench: $(TEST_SETUP)
	$(MPIEXEC) -n 2 $(PY) bench/collectives.py --json bench/results-collectives-2ranks.json

clean:
	rm -rf $(VENV) build dist *.egg-info

# torch's own distributed test suite (DistributedTest._DistTestBase, ~290 tests, each spawning its
# ranks through torch.multiprocessing) on "ddl", then on gloo for reference, then the table. About
# 20 minutes per backend on 2 cores, so not part of `make test` (tests/multirank/test_torch_suite.py runs a subset).
.PHONY: torch-suite
TORCH_SUITE_WORLD ?= 2
torch-suite: $(TEST_SETUP)
	mkdir -p build
	cd tests && nice -n 19 ../$(PY) multirank/torch_suite.py --backend ddl --world-size $(TORCH_SUITE_WORLD) --json ../build/torch_suite-ddl.json > ../build/torch_suite-ddl.log 2>&1 || true
	cd tests && nice -n 19 ../$(PY) multirank/torch_suite.py --backend gloo --world-size $(TORCH_SUITE_WORLD) --json ../build/torch_suite-gloo.json > ../build/torch_suite-gloo.log 2>&1 || true
	$(PY) tests/multirank/torch_suite.py --table build/torch_suite-ddl.json build/torch_suite-gloo.json
