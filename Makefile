# The two README commands: `make demo` and `make test`. Everything they need is installed here.
# `make docs` builds the documentation site (mkdocs.yml, docs/) into site/.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch is installed first and on its own: on the CPU-only machines this project is developed on,
# `torch==2.13.0` resolves to a local CPU wheel, while a bare `torch` would pull gigabytes of CUDA
# packages. pyproject needs torch>=$(TORCH_FLOOR): an installed torch that new is kept, an older one
# replaced. Versions compare as (major, minor) numbers: as strings, '2.9.1' >= '2.11' would hold.
TORCH_SPEC ?= torch==2.13.0
TORCH_FLOOR := 2.11
DEMO_DIR ?= outputs/sweeps/demo

.PHONY: demo test test-slow docs install install-dev clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.torch: | $(PY)
	$(PY) -c "import sys, importlib.metadata as m; ver = lambda v: tuple(int(x) for x in v.split('+')[0].split('.')[:2]); sys.exit(ver(m.version('torch')) < ver('$(TORCH_FLOOR)'))" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	touch $@

# The hf extra (transformers) comes with the plain install: the README's tour and its "Will my model
# fit my GPU?" recipe build Hugging Face models, which without it are rows of `invalid`.
$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(PY) -m pip install -q -e '.[hf]'
	touch $@

$(VENV)/.installed-dev: pyproject.toml $(VENV)/.installed
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

# A 2 x 2 grid of a tiny GPT on CPU (on a GPU when one is present), then its report.
demo: install
	$(PY) -m ablate -m experiment=demo optimizer=adamw,sgd batch_size=8,16 \
		hydra.sweep.dir=$(DEMO_DIR)
	$(PY) -m analysis.report $(DEMO_DIR)

# The tests run in parallel, one worker per core, a test file to a worker (module fixtures run once);
# TEST_WORKERS=0 runs them in this process. Both targets list their 15 slowest tests, to keep the budget in view.
TEST_WORKERS ?= auto
test: install-dev
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15

# The long CPU tests (the preset benchmarks at toy size, torch.compile): CI runs them after `make test`,
# a worker per core as it does. SERIAL_SLOW's files run alone afterwards, one test at a time: they
# start a SLURM cluster of their own, pin CPUs, or hold a command to a wall-clock figure.
SERIAL_SLOW = tests/test_slurm.py tests/test_slurm_nodes.py tests/test_cluster_scale.py tests/test_sweep_startup.py \
	tests/test_faults.py tests/test_gpu_pool.py tests/test_cpus.py tests/test_parallel.py
test-slow: install-dev
	$(PY) -m pytest -q -m slow -n $(TEST_WORKERS) --dist loadfile --durations=15 $(addprefix --ignore=,$(SERIAL_SLOW))
	$(PY) -m pytest -q -m slow --durations=15 $(SERIAL_SLOW)

# --strict: a broken link or anchor, or a page missing from mkdocs.yml's nav, fails the build.
# NO_MKDOCS_2_WARNING quiets mkdocs-material's banner about its successor.
docs: install-dev
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) outputs .pytest_cache site
