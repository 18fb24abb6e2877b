# minitron: `make lab` opens the course, `make test` runs every test. Both set up .venv first.
PYTHON ?= python3
# The package needs torch>=2.4; the set-up pins one release so a CPU-only machine that
# already holds it (or macOS, where PyPI's wheel is CPU-only) installs it quickly.
# Override for your machine, e.g. `make test TORCH='torch==2.11.0'`.
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.minitron-installed

.PHONY: setup lab test browser-test grade verify-all verify-matrix bench gpu-check clean-venv

setup: $(STAMP)

# Makefile too: a change of the extras below reaches an existing .venv.
# torch comes through pip, so a pip set up for this machine (a local wheel folder, a CPU index)
# is obeyed; the rest through uv when it can be had (it fetches and installs in parallel: a fresh
# clone's `make setup` took 57 s instead of 86 s here, uv's cache cold), else through pip. Both
# leave compiled bytecode, which every process's imports would otherwise compile again.
$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet "$(TORCH)"
	@$(BIN)/python -m pip install --quiet uv 2>/dev/null || echo "uv not available: installing with pip"
	@if test -x $(BIN)/uv; then \
	  $(BIN)/uv pip install --python $(BIN)/python --quiet --compile-bytecode -e ".[course,kernels,test,hf]"; \
	else \
	  $(BIN)/python -m pip install --quiet -e ".[course,kernels,test,hf]"; \
	fi
	@touch $(STAMP)

# Jupyter refuses to run as root unless told to (containers and cloud machines often are root).
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)
lab: setup
	$(BIN)/jupyter lab $(ALLOW_ROOT) lessons/00_collectives.ipynb

# The whole suite: unit and multi-process tests, every lesson and solution under nbval,
# and every unsolved exercise shown to fail its grading. The set-up installs the hf extra
# (transformers, CPU-only), so tests/test_hf.py's comparisons with transformers run too. Test
# files run whole on one of up to four workers (pytest-xdist, one more than the CPUs: a worker
# often waits on processes it started; tests/conftest.py has the timings): a module's fixtures,
# such as the grading one, run once, and the many tests that mostly wait on gloo overlap with
# the ones that compute. Files go out in collection order, the longest first
# (tests/conftest.py: LONG_POLES), not by test count. -p no:nbval: the lessons run in nbval
# processes of their own (tests/test_notebooks.py); here the plugin would only import jsonschema's
# rfc3987 grammar before conftest.py can hide it, about 2 s of CPU in each pytest process.
# PYTHONDONTWRITEBYTECODE emptied: where the machine sets it, every process (each worker, the
# nbval and grading runs, each command a test starts) would compile minitron again, and pytest
# rewrite every test file's asserts again; with the cache `pytest --collect-only` took 3.5 CPU-s
# instead of 5.0.
test: setup
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -p no:nbval -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder

# Lesson 04's explorer in a real browser: JupyterLab + headless Chromium (selenium). Needs
# `apt-get install chromium chromium-driver` (Debian/Ubuntu); fails, not skips, without them.
# SCREENSHOT=lessons/figures/pipeline_explorer.png keeps a picture of the page.
SCREENSHOT ?=
browser-test: setup
	$(BIN)/python -m pip install --quiet -e ".[browser]"
	MINITRON_BROWSER_TEST=1 SCREENSHOT="$(SCREENSHOT)" $(BIN)/python -m pytest -q tests/test_browser.py

# Grade your exercises: `make grade` for all, `make grade NB=exercises/01_tensor_parallel_mlp.ipynb` for one.
# Your answer cells run inside the reference solution, against its checks and stored outputs.
NB ?= exercises
grade: setup
	$(BIN)/python -m minitron.grade $(NB)

verify-all: setup
	$(BIN)/python -m minitron.verify --tp 2 --steps 3
	$(BIN)/python -m minitron.verify --tp 2 --sp --steps 3
	$(BIN)/python -m minitron.verify --tp 4 --sp --steps 3 --norm rmsnorm --activation swiglu --position rope
	$(BIN)/python -m minitron.verify --tp 2 --sp --steps 3 --kernels
	$(BIN)/python -m minitron.verify --tp 1 --dp 2 --steps 3
	$(BIN)/python -m minitron.verify --tp 2 --sp --dp 2 --steps 3
	$(BIN)/python -m minitron.verify --tp 1 --dp 2 --pp 2 --schedule 1f1b --microbatches 4 --steps 3
	$(BIN)/python -m minitron.verify --tp 1 --dp 4 --zero 3 --steps 3
	$(BIN)/python -m minitron.verify --tp 1 --dp 2 --pp 2 --zero 3 --schedule zb-h1 --microbatches 4 --steps 3
	$(BIN)/python -m minitron.verify --tp 2 --sp --dp 2 --pp 2 --zero 3 --schedule 1f1b --microbatches 4 --steps 3
	$(BIN)/python -m minitron.verify --tp 2 --sp --dp 2 --zero 1 --steps 3
	$(BIN)/python -m minitron.verify --tp 2 --sp --steps 3 --dtype bfloat16
	$(BIN)/python -m minitron.verify --tp 2 --sp --steps 3 --dtype float16
	$(BIN)/python -m minitron.verify --ep 2 --experts 4 --topk 2 --steps 3
	$(BIN)/python -m minitron.verify --ep 2 --tp 2 --sp --experts 4 --steps 3
	$(BIN)/python -m minitron.verify --ep 4 --experts 8 --capacity-factor 1.0 --steps 3
	$(BIN)/python -m minitron.verify --ep 2 --dp 2 --experts 4 --steps 3
	$(BIN)/python -m minitron.verify --tp 1 --cp 2 --steps 3
	$(BIN)/python -m minitron.verify --tp 1 --cp 4 --steps 3
	$(BIN)/python -m minitron.verify --tp 2 --sp --cp 2 --steps 3
	$(BIN)/python -m minitron.verify --tp 1 --cp 2 --cp-variant ulysses --steps 3
	$(BIN)/python -m minitron.verify --tp 1 --cp 2 --cp-variant allgather --steps 3
	$(BIN)/python -m minitron.verify --tp 1 --cp 2 --dp 2 --steps 3
	$(BIN)/python -m minitron.verify --tp 1 --cp 2 --pp 2 --schedule 1f1b --microbatches 4 --steps 3
	$(BIN)/python -m minitron.verify --tp 1 --cp 2 --pp 2 --schedule zb-h1 --microbatches 4 --steps 3
	$(BIN)/python -m minitron.verify --tp 2 --sp --cp 2 --pp 2 --schedule 1f1b --microbatches 4 --steps 3
	$(BIN)/python -m minitron.verify --tp 1 --cp 2 --pp 2 --dp 2 --schedule 1f1b --microbatches 4 --steps 3
	$(BIN)/python -m minitron.verify --tp 1 --cp 2 --pp 2 --virtual 2 --layers 4 --schedule interleaved --microbatches 4 --steps 3

# Every combination of tp, pp, dp, cp, ep in {1, 2} on at most 8 ranks; the table is kept in
# bench/results/verify_matrix.md (lesson 12 reads it).
verify-matrix: setup
	@mkdir -p bench/results
	{ printf '# python -m minitron.verify --matrix, %s\n\ncommit %s\n\n%s\n\n```\n' "$$(date -u +%Y-%m-%d)" \
	    "$$(git rev-parse --short HEAD 2>/dev/null || echo '(not a git checkout)')$$(git diff --quiet HEAD -- minitron 2>/dev/null || echo ' with uncommitted changes to minitron/')" \
	    "$$($(BIN)/python -c 'from minitron.bench.overhead import machine; print(machine())')"; \
	  $(BIN)/python -m minitron.verify --matrix | grep -v '^  '; printf '```\n'; } \
	  > bench/results/verify_matrix.md
	@cat bench/results/verify_matrix.md

bench: setup
	$(BIN)/python -m minitron.bench overhead
	$(BIN)/python -m minitron.bench overlap
	$(BIN)/python -m minitron.bench peers
	$(BIN)/python -m minitron.bench kernels

# Everything that needs a GPU, at most 8 minutes on one H200; CSVs in bench/results/ named by
# GPU and date, a summary table at the end (`python -m minitron.bench gpu --dry-run`: what it runs).
gpu-check: setup
	$(BIN)/python -m minitron.bench gpu

clean-venv:
	rm -rf $(VENV)
