# vapo_jax: every target installs what it needs into .venv first (once; a stamp file records it).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stamp-install
EXP ?= tiny
ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help install train test test-slow lint bench eval clean clean-cache

help:  ## List the targets.
	@echo "vapo_jax make targets:"
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | awk -F'\t' '{printf "  make %-10s %s\n", $$1, $$2}'
	@echo "Variables: EXP=<experiment> (default tiny), ARGS=\"field.path=value ...\" (config overrides), TOPOLOGY=v5p:8x8x4 (make memory)"

# ".[plot]": matplotlib, so that a finished run draws its curve of held-out accuracy and reward.
# --no-compile: Python writes the bytecode of the modules a run imports as it first imports them, a fraction of
# the installed files; pip would compile every file of every package first (half the install's CPU time).
# Hence make's commands write bytecode even where the environment sets PYTHONDONTWRITEBYTECODE: without it,
# every Python process (each test process, each run a test starts) compiles JAX's, Flax's and the package's
# sources again, 4-5 CPU seconds each. The bytecode lands in .venv/ and the clone's __pycache__/ (gitignored).
unexport PYTHONDONTWRITEBYTECODE
# setuptools' editable build warns, with its source lines, of folders named like the package: the repository's
# own layout, nothing for a user to act on.
PIP_QUIET := PYTHONWARNINGS=ignore
comma := ,
# $(call install,EXTRAS): .venv created if missing, then the package with EXTRAS in one call (one resolve): by uv
# (PyPI's, installed into .venv by pip), which resolves and installs the same packages as pip in a third of the
# time (`make lint` in a fresh clone, .venv included: 43 s → 15 s on a 2-core machine; like --no-compile, it writes
# no bytecode up front); by pip where uv cannot be had or fails.
define install
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "vapo_jax needs Python >= 3.11, found " + sys.version'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@test -x $(VENV)/bin/uv || $(PY) -m pip install --quiet uv || true
	$(PIP_QUIET) $(VENV)/bin/uv pip install --python $(PY) --quiet -e ".[$(1)]" 2>/dev/null || \
	  { $(PY) -m pip install --quiet --upgrade pip && $(PIP_QUIET) $(PY) -m pip install --quiet --no-compile -e ".[$(1)]"; }
endef
$(STAMP): setup.py
	$(call install,plot)
	@touch $(STAMP)

# The extras, each installed once by the targets that need it: "test" (make test, lint) with "tpu" (libtpu's
# compile-only client: make memory TOPOLOGY=, and the compile report's tests). make test in a fresh clone installs
# the run's and the tests' in one call.
TEST_STAMP := $(VENV)/.stamp-test
$(TEST_STAMP): setup.py
	$(call install,plot$(comma)test$(comma)tpu)
	@touch $(STAMP) $(TEST_STAMP)
TPU_STAMP := $(VENV)/.stamp-tpu
$(TPU_STAMP): setup.py $(STAMP)
	$(call install,plot$(comma)tpu)
	@touch $(TPU_STAMP)

install: $(STAMP)  ## Create .venv and install the package and what a run needs (make test adds its extras).

# XLA's compilation cache for make train, make test and make memory: .jax_cache/ in the clone (gitignored;
# or JAX_COMPILATION_CACHE_DIR), at most JAX_CACHE_GIB GiB: the least recently used files are deleted as a
# run starts. A run after the first loads what it compiled before (for a TPU topology, what the compiler
# said of each program: vapo_jax/memory/compiled_cache.py); the first run on a fresh machine compiles
# everything. make clean-cache empties it.
JAX_CACHE_GIB ?= 2
JAX_CACHE = JAX_COMPILATION_CACHE_DIR="$${JAX_COMPILATION_CACHE_DIR:-$(CURDIR)/.jax_cache}" VAPO_JAX_CACHE_MAX_GIB=$(JAX_CACHE_GIB)

# train, eval and sweep exec Python (no shell between make and it): a signal to the process group reaches it as it
# would the command alone, and its stop saves its checkpoint even when make, and with it the output pipe, is gone.
train: $(STAMP)  ## Run experiment EXP (default: the tiny CPU experiment) with overrides ARGS.
	exec env $(JAX_CACHE) $(PY) -m vapo_jax.cli.train --exp $(EXP) $(ARGS)

# make test compiles at XLA's backend optimisation level 0 (a third less compile time) with the CPU's fusion
# emitters off (about 40 % less again); the settings differ from the defaults only in rounding, bounded by
# tests/test_optimisation_level.py. make test-slow, make bench and runs compile at the defaults.
TEST_JOBS ?= 2
test: $(TEST_STAMP)  ## Run the test suite (8 virtual CPU devices; slow tests excluded), TEST_JOBS processes at once (2); TEST_ARGS: more pytest arguments.
	$(JAX_CACHE) XLA_FLAGS="--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false $$XLA_FLAGS" \
	  $(PY) -m pytest -q -m "not slow" -n $(TEST_JOBS) --dist loadfile --durations=15 $(TEST_ARGS) tests

test-slow: $(TEST_STAMP)  ## Run the slow tests: SIGKILL-and-resume exactness, 2 processes vs 1, 1 vs 8 devices, the heavier trainer runs and test variants (~20 min).
	$(PY) -m pytest -q -m slow tests

lint: $(TEST_STAMP)  ## ruff check over the repository (its rules, and each ignored one's reason: ruff.toml).
	$(VENV)/bin/ruff check .

bench: $(STAMP)  ## Print the benchmarks: GAE vs baselines; 0.5B forward tokens/s; rollout (decode, refill, top-p, vs transformers); paged vs contiguous refill at equal KV bytes; long sequences; packed vs padded updates; pod (decode per layout, reshard).
	$(PY) -m benchmarks.gae_bench
	$(PY) -m benchmarks.model_bench
	$(PY) -m benchmarks.rollout_bench
	$(PY) -m benchmarks.paged_bench
	$(PY) -m benchmarks.long_seq_bench
	$(PY) -m benchmarks.packing_bench
	$(PY) -m benchmarks.pod_bench

# The GPU check runs with .venv's Python where make install made one, else the machine's own (a lent GPU machine
# installs nothing: its Python has jax with the CUDA plugin, flax, optax, orbax-checkpoint, transformers, numpy).
.PHONY: gpu-check
gpu-check:  ## On an NVIDIA GPU: its kernels against the oracles, update tokens/s and MFU, paged decode vs gather, make memory, one RL step of math with its MFU (QUICK=1: small shapes); "no GPU" elsewhere.
	PYTHONPATH=$(CURDIR) $(if $(wildcard $(PY)),$(PY),$(PYTHON)) -m benchmarks.gpu_check $(if $(QUICK),--quick)

eval: $(STAMP)  ## Score EXP's eval set: RESPONSES=file.jsonl (saved samples) or CKPT=dir.
	exec env $(JAX_CACHE) $(PY) -m vapo_jax.cli.evaluate --exp $(EXP) $(if $(CKPT),--ckpt $(CKPT)) $(if $(RESPONSES),--responses $(RESPONSES)) $(if $(OUT),--out $(OUT)) $(ARGS)

PLOT_STAMP := $(VENV)/.stamp-plot
$(PLOT_STAMP): setup.py $(STAMP)
	$(PIP_QUIET) $(PY) -m pip install --quiet -e ".[plot]"
	@touch $(PLOT_STAMP)

.PHONY: plot
plot:  ## PNG curves of a run's metrics.jsonl: RUN=runs/<name> (written to RUN/plots/).
	@test -n "$(RUN)" || { echo "make plot needs RUN=runs/<name> (a run directory holding metrics.jsonl)"; exit 2; }
	@$(MAKE) -s --no-print-directory $(PLOT_STAMP)
	$(PY) -m vapo_jax.cli.plots $(RUN) $(if $(OUT),--out $(OUT))

SEEDS ?= 0,1,2
JOBS ?= 1
.PHONY: sweep
sweep:  ## Every member of SWEEP (e.g. toy) × SEEDS, JOBS at once → runs/sweeps/SWEEP/ (table.md, runs.csv, plots/); PRINT=1: list the runs.
	@test -n "$(SWEEP)" || { echo "make sweep needs SWEEP=<name>, e.g. make sweep SWEEP=toy SEEDS=0,1,2 (registered: experiments/__init__.py SWEEPS)"; exit 2; }
	@$(MAKE) -s --no-print-directory $(PLOT_STAMP)
	$(if $(PRINT),@)exec $(PY) -m vapo_jax.cli.sweep $(SWEEP) --seeds $(SEEDS) --jobs $(JOBS) $(if $(PRINT),--print-commands) $(if $(SMOKE),--smoke) $(ARGS)

.PHONY: memory
memory: $(STAMP)  ## XLA's per-device memory of EXP's every program, compiled for TOPOLOGY (v5p:8x8x4, cpu:8; default: this machine's devices; MESH=fsdp=256; LAYERS=2: a quick look; PROFILE=runs/<name>: also price the rollout at its logged lengths; REMAT=1: also the update under every model.remat policy); exit 1 if a phase does not fit, naming the fix.
	@$(if $(filter v%,$(TOPOLOGY)),$(MAKE) -s --no-print-directory $(TPU_STAMP),true)
	$(JAX_CACHE) $(PY) -m vapo_jax.cli.memory --exp $(EXP) $(if $(TOPOLOGY),--topology $(TOPOLOGY)) $(if $(LAYERS),--layers $(LAYERS)) $(if $(MESH),--mesh $(MESH)) $(if $(PROFILE),--profile $(PROFILE)) $(if $(REMAT),--remat) $(ARGS)

clean-cache:  ## Empty XLA's compilation cache (.jax_cache/).
	rm -rf .jax_cache

clean:  ## Remove .venv, caches (.jax_cache/ too) and runs/.
	rm -rf $(VENV) .pytest_cache .hypothesis .jax_cache runs *.egg-info
