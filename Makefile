# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install clean benchmarks

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, so the package's torch>=2.4 needs nothing more. Where the index offers a
	# CPU wheel for this pin (as on our development machines) this is the CPU build; on a plain
	# PyPI index it is the CUDA build (several GB): for a CPU-only machine use
	# TORCH_INDEX=https://download.pytorch.org/whl/cpu make install
	$(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# the hinge on one seed, certified, with its safety report, card and figures (about 40 s of CPU); the wider
# evaluation (docs/demo.md): add --penalties hinge,squared_hinge,none --seeds 100,101,102,103,104 --workers 5
demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m hf_constrained.recipes.demo_clip_digits

test: $(STAMP)
	# the linter first (pyproject.toml: line length 120, pycodestyle, pyflakes, import order)
	$(VENV)/bin/ruff check .
	# one thread per xdist worker: the tests use tiny models, threads would only contend
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n 2 --dist loadgroup tests

clean:
	rm -rf $(VENV) build *.egg-info
