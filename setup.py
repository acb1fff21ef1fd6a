"""minispec's build step: the quantized products (native/ggml_shim.c with llama.cpp's ggml CPU kernels,
native/iqk_shim.c with ik_llama.cpp's row-tiled ones, built by tools/build_ggml.py) compiled into the package when
their sources (under build/, fetched by `make setup`) and a compiler are there. Without them the install still
succeeds: minispec then uses the other product, or computes kept matrices in PyTorch, and says so once at first
use. Everything else is in pyproject.toml."""

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
        except Exception as e:  # noqa: BLE001 - any failure leaves the PyTorch path, never a failed install
            print(f"minispec: quantized products not built: {e}", file=sys.stderr)
            return
        for what, find, make in (("llama.cpp's", builder.source, builder.build),
                                 ("ik_llama.cpp's", builder.ik_source, builder.build_ik)):
            try:
                src = find(fetch=False)
                if src is None:
                    print(f"minispec: {what} quantized product not built (no source: `make setup` or "
                          "`python tools/build_ggml.py` fetches it)", file=sys.stderr)
                    continue
                make(src, dest)
            except Exception as e:  # noqa: BLE001 - any failure leaves the other paths, never a failed install
                print(f"minispec: {what} quantized product not built: {e}", file=sys.stderr)


setup(cmdclass={"build_py": BuildPyWithProduct})
