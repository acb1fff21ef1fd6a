"""minispec's build step: the quantized product (native/ggml_shim.c with llama.cpp's ggml CPU kernels, built by
tools/build_ggml.py) compiled into the package when llama.cpp's source (build/llama.cpp, fetched by `make setup`)
and a compiler are there. Without them the install still succeeds: minispec then computes kept matrices in
PyTorch, and says so once at first use. Everything else is in pyproject.toml."""

import importlib.util
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithProduct(build_py):
    def run(self):
        super().run()
        dest = ROOT / "minispec" if self.editable_mode else Path(self.build_lib) / "minispec"
        try:
            spec = importlib.util.spec_from_file_location("build_ggml", ROOT / "tools" / "build_ggml.py")
            builder = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(builder)
            src = builder.source(fetch=False)
            if src is None:
                print("minispec: quantized product not built (no llama.cpp source: `make setup` or "
                      "`python tools/build_ggml.py` fetches it)", file=sys.stderr)
                return
            builder.build(src, dest)
        except Exception as e:  # noqa: BLE001 - any failure leaves the PyTorch path, never a failed install
            print(f"minispec: quantized product not built: {e}", file=sys.stderr)


setup(cmdclass={"build_py": BuildPyWithProduct})
