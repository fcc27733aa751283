# Two commands do all the set-up on a fresh machine:  make demo  and  make test.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
MPIEXEC := $(VENV)/bin/mpiexec
STAMP  := $(VENV)/.ddl_triton-installed
RANKS  ?= 4

.PHONY: setup demo test bench clean

setup: $(STAMP)

# CPU torch first, pinned: an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

# tests/multirank/test_demo.py runs these two commands at a reduced size, so a broken demo cannot land.
demo: $(STAMP)
	$(VENV)/bin/ddlrun -n $(RANKS) -- $(PY) examples/demo.py
	$(VENV)/bin/ddlrun -n $(RANKS) -- $(PY) examples/train_cnn.py --hook int8

# Bytecode first: the environment may set PYTHONDONTWRITEBYTECODE, and then every rank process
# the suite starts would compile ddl_triton from source again (about 0.1 s of CPU each, measured).
test: $(STAMP)
	$(PY) -m compileall -q ddl_triton transports schedules tests bench examples > /dev/null
	$(PY) -m pytest -q

bench: $(STAMP)
	$(MPIEXEC) -n 2 $(PY) bench/collectives.py --json bench/results-collectives-2ranks.json

clean:
	rm -rf $(VENV) build *.egg-info

# torch's own distributed test suite (DistributedTest._DistTestBase, ~290 tests, each spawning its
# ranks through torch.multiprocessing) on "ddl", then on gloo for reference, then the table. About
# 20 minutes per backend on 2 cores, so not part of `make test` (tests/multirank/test_torch_suite.py runs a subset).
.PHONY: torch-suite
TORCH_SUITE_WORLD ?= 2
torch-suite: $(STAMP)
	mkdir -p build
	cd tests && nice -n 19 ../$(PY) multirank/torch_suite.py --backend ddl --world-size $(TORCH_SUITE_WORLD) --json ../build/torch_suite-ddl.json > ../build/torch_suite-ddl.log 2>&1 || true
	cd tests && nice -n 19 ../$(PY) multirank/torch_suite.py --backend gloo --world-size $(TORCH_SUITE_WORLD) --json ../build/torch_suite-gloo.json > ../build/torch_suite-gloo.log 2>&1 || true
	$(PY) tests/multirank/torch_suite.py --table build/torch_suite-ddl.json build/torch_suite-gloo.json
