# make demo  : set up .venv (once) and run the embedded default on the CPU
# make test  : set up .venv (once) and run the test suite
# make lint  : ruff's format check and lint
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
# torch's CPU wheels: PyPI's torch wheel for Linux is the CUDA build (~0.5 GB, plus ~20 CUDA packages)
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: demo test lint venv clean

venv: $(STAMP)

# Reinstall only when requirements.txt changes (the stamp is newer otherwise).
$(STAMP): requirements.txt
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check --extra-index-url $(TORCH_CPU_INDEX) -r requirements.txt
	touch $(STAMP)

# Its own --out, runs/demo, so that `python train_grpo.py ...` afterwards starts afresh in its default
# --out; --start-over: a second `make demo` moves the first one's runs/demo aside (runs/demo.old-<time>)
demo: $(STAMP)
	$(VENV)/bin/python train_grpo.py --out runs/demo --start-over

test: $(STAMP)
# Two pytest workers (pytest-xdist), each taking whole files (module fixtures shared, e.g. the
# layouts of a torchrun launch): single-process tests fill the second core while another file
# runs. Scripts the tests run start as forks of tests/zygote.py (torch and megatron-core imported
# once per worker; TESTS_REAL_PROCESSES=1 for real processes). The longest files first
# (tests/schedule.py; xdist's own reorder by test count off). The slowest 15 listed: the suite
# must stay under 20 min on 2 cores.
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15 tests

# ruff: the formatter's check and the linter (pyproject.toml); `.venv/bin/ruff format .` applies the format
lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV)
