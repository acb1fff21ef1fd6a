"""Fuzzing the loaders: hypothesis-made mutations of valid tiny files, each loaded as a user would.

Four targets, each a valid tiny file spoiled by one to three mutations:
- model.safetensors of a minispec checkpoint: bit flips, truncation, random bytes, the header's
  length field set to an extreme, values in its JSON header replaced (shapes, offsets, dtypes);
- config.json: values replaced by NaN, infinities, huge numbers, strings, nulls, lists, objects;
  keys dropped or added; bytes flipped; non-UTF-8 bytes;
- a llama GGUF file with a gpt2-style or a SentencePiece vocabulary (converted with
  tools/convert_gguf.py): bit flips, truncation, length and count fields (string lengths, array
  counts, tensor dims and offsets) and numeric values set to extremes or NaN;
- tokenizer.json and tokenizer_config.json: as config.json.

Two more targets check properties rather than refusals:
- a valid tokenizer.json given padding and truncation settings (any strategy, direction and length,
  10**9 included): it loads, and encodes and decodes exactly as the same file without them;
- save_pretrained into an existing directory holding foreign files (nested, hidden, some named
  like a checkpoint's own files) and perhaps an older checkpoint: every foreign file not named
  like a checkpoint file survives unchanged, the directory loads as the model saved, and nothing
  is left beside it.

Every outcome of the first four must be a clean load, whose result is then used (a few generated tokens, an
encode/decode round, a chat prompt, the converted checkpoint loaded), or minispec's own error
type (errors.InputError and its subclasses). Each example runs under a time bound (SIGALRM)
and the whole test under an address-space bound (RLIMIT_AS), and a failed conversion leaves no
half-written output. The examples are derandomized (the same ones every run); set
MINISPEC_FUZZ_EXAMPLES (default 150 per target) for a longer run.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import struct
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minispec import Transformer
from minispec.checkpoint import CHECKPOINT_FILES
from minispec.errors import InputError
from minispec.tokenizer import load_tokenizer

import convert_gguf as conv
from helpers import leftovers
from tiny_files import WORDS, llama_vocab, tiny_checkpoint, tiny_gguf, tiny_tokenizer_dir

gguf = pytest.importorskip("gguf")

EXAMPLES = int(os.environ.get("MINISPEC_FUZZ_EXAMPLES", "150"))
SECONDS_PER_EXAMPLE = 30  # a hang is a failure, not a stuck test run
EXTRA_MEMORY = 4 * 2**30  # what the loaders may allocate beyond the test process's size at the start
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

HOSTILE_VALUES = [float("nan"), float("inf"), float("-inf"), 0, -1, 1, 2, 10**9, 2**31 - 1, 2**31, 2**63, 2**64 + 1,
                  10**300, 1e300, 1e-300, 0.5, 10**4000, "", "1e-5", "2", "false", "</s>", "x" * 100_000, None, True,
                  False, [], {}, [1, 2], {"a": 1}, [[[[[]]]]]]
U64_EXTREMES = [0, 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**64 - 1]


# ---------------------------------------------------------------------------------------------
# mutations

def json_paths(obj, prefix=()):
    """Every path (tuple of keys / indices) into a JSON value, the root included."""
    yield prefix
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield from json_paths(v, prefix + (k,))


@st.composite
def json_mutation(draw, obj):
    """A copy of the JSON value `obj` with one value replaced, one key dropped or one key added."""
    obj = json.loads(json.dumps(obj))
    paths = list(json_paths(obj))
    path = draw(st.sampled_from(paths[1:] or paths))
    kind = draw(st.sampled_from(["replace", "replace", "replace", "drop", "add"]))
    if not path:
        return draw(st.sampled_from(HOSTILE_VALUES))
    parent = obj
    for k in path[:-1]:
        parent = parent[k]
    if kind == "replace":
        parent[path[-1]] = draw(st.sampled_from(HOSTILE_VALUES))
    elif kind == "drop":
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent["unexpected_" + str(len(parent))] = draw(st.sampled_from(HOSTILE_VALUES))
    else:
        parent.append(draw(st.sampled_from(HOSTILE_VALUES)))
    return obj


@st.composite
def byte_mutation(draw, blob: bytes, fields: list[tuple[int, np.dtype]] = ()):
    """`blob` with one to three of: a bit flipped, a cut, random bytes written, a numeric field set to an extreme."""
    data = bytearray(blob)
    for _ in range(draw(st.integers(1, 3))):
        kinds = ["flip", "cut", "bytes"] + (["field", "field"] if fields else [])
        kind = draw(st.sampled_from(kinds))
        if not data:
            break
        pos = draw(st.integers(0, len(data) - 1))
        if kind == "flip":
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "cut":
            del data[pos:]
        elif kind == "bytes":
            data[pos:pos + 8] = draw(st.binary(min_size=1, max_size=8))
        else:
            off, dtype = draw(st.sampled_from(fields))
            if dtype.kind == "f":
                value = np.array(draw(st.sampled_from([np.nan, np.inf, -np.inf, 0.0, -1.0, 1e38])), dtype=dtype)
            else:
                info = np.iinfo(dtype)
                value = np.array(draw(st.sampled_from([0, 1, info.max, info.max // 2, info.min])), dtype=dtype)
            raw = value.tobytes()
            if off + len(raw) <= len(data):
                data[off:off + len(raw)] = raw
    return bytes(data)


def json_bytes(obj) -> bytes:
    return json.dumps(obj).encode()  # NaN and Infinity as json.dumps writes them: what Python's json reads back


def gguf_fields(path: Path) -> list[tuple[int, np.dtype]]:
    """(byte offset, dtype) of every numeric field of a GGUF file: lengths, counts, dims, offsets and values."""
    reader = gguf.GGUFReader(str(path))
    base = reader.data.ctypes.data
    parts = [p for f in reader.fields.values() for p in f.parts] + [p for t in reader.tensors for p in t.field.parts]
    out = []
    for p in parts:
        if p.dtype.kind in "iuf" and p.size == 1:
            out.append((p.ctypes.data - base, p.dtype))
    return out


# ---------------------------------------------------------------------------------------------
# bounds

@pytest.fixture
def bounded():
    """An address-space limit for the whole test and a time limit for each example (SIGALRM)."""
    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    old = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (size + EXTRA_MEMORY, old[1]))

    def timeout(signum, frame):
        raise TimeoutError(f"a fuzz example ran longer than {SECONDS_PER_EXAMPLE} s")

    previous = signal.signal(signal.SIGALRM, timeout)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        resource.setrlimit(resource.RLIMIT_AS, old)


def attempt(outcomes: Counter, stage: str, run) -> object | None:
    """run() under the per-example time bound: its result, or None when it raised an InputError.

    Counts the outcome under `stage` ("load": reading the file; "use": what a user does next).
    """
    signal.setitimer(signal.ITIMER_REAL, SECONDS_PER_EXAMPLE)
    try:
        result = run()
        outcomes[f"{stage} ok"] += 1
        return result
    except InputError as e:
        outcomes[f"{stage} refused: {type(e).__name__}"] += 1
        return None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def use_model(model: Transformer) -> None:
    """What a user does next: a few greedy tokens (NaN weights are a SamplingError, an InputError)."""
    model.generate([1, 2], max_new_tokens=2, stop_tokens=[])


def load_spoiled_checkpoint(valid: Path, tmp_path: Path, name: str, spoiled: bytes, outcomes: Counter) -> None:
    """The valid checkpoint with its file `name` replaced by `spoiled`: loaded and, when it loads, used."""
    d = tmp_path / "ckpt"
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(valid / "ckpt", d)
    (d / name).write_bytes(spoiled)
    model = attempt(outcomes, "load", lambda: Transformer.from_pretrained(d))
    if model is not None:
        attempt(outcomes, "use", lambda: use_model(model))


def report(name: str, outcomes: Counter) -> None:
    """Print the outcomes (run with -s to see them); a fuzzer whose mutations never load, or never fail, is blind."""
    loads = sum(n for k, n in outcomes.items() if k.startswith("load"))
    print(f"\nfuzz {name}: {loads} examples: {dict(sorted(outcomes.items()))}")
    assert outcomes["load ok"] and loads > outcomes["load ok"], f"{name}: the mutations never loaded or never failed"


# ---------------------------------------------------------------------------------------------
# the four targets

@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    root = tmp_path_factory.mktemp("valid")
    tiny_checkpoint(root / "ckpt", eos_id=2)
    tiny_tokenizer_dir(root / "tok")
    tiny_gguf(root / "gpt2.gguf")  # its vocabulary becomes a tokenizer.json
    tiny_gguf(root / "llama.gguf", llama_vocab())  # a tokenizer.model (sentencepiece)
    tiny_checkpoint(root / "with_tok", seed=1, eos_id=2)
    tiny_tokenizer_dir(root / "with_tok")
    return root


def test_fuzz_safetensors(valid, tmp_path, bounded):
    blob = (valid / "ckpt" / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    outcomes = Counter()

    @FUZZ
    @given(data=st.data())
    def run(data):
        if data.draw(st.booleans()):  # the header's JSON
            raw = json.dumps(data.draw(json_mutation(header))).encode()
            length = data.draw(st.sampled_from([len(raw)] * 4 + U64_EXTREMES))
            spoiled = struct.pack("<Q", length) + raw + blob[8 + n:]
        else:  # the bytes, the length field among them
            spoiled = data.draw(byte_mutation(blob, [(0, np.dtype("<u8"))]))
        load_spoiled_checkpoint(valid, tmp_path, "model.safetensors", spoiled, outcomes)

    run()
    report("safetensors", outcomes)


def test_fuzz_config_json(valid, tmp_path, bounded):
    config = json.loads((valid / "ckpt" / "config.json").read_text())
    raw = (valid / "ckpt" / "config.json").read_bytes()
    outcomes = Counter()

    @FUZZ
    @given(data=st.data())
    def run(data):
        spoiled = json_bytes(data.draw(json_mutation(config))) if data.draw(st.integers(0, 3)) else \
            data.draw(byte_mutation(raw))
        load_spoiled_checkpoint(valid, tmp_path, "config.json", spoiled, outcomes)

    run()
    report("config.json", outcomes)


def test_fuzz_gguf(valid, tmp_path, bounded):
    files = {name: ((valid / name).read_bytes(), gguf_fields(valid / name)) for name in ("gpt2.gguf", "llama.gguf")}
    outcomes = Counter()

    @FUZZ
    @given(data=st.data())
    def run(data):
        src, dst = tmp_path / "m.gguf", tmp_path / "out"
        blob, fields = files[data.draw(st.sampled_from(sorted(files)))]
        src.write_bytes(data.draw(byte_mutation(blob, fields)))
        shutil.rmtree(dst, ignore_errors=True)
        cfg = attempt(outcomes, "load", lambda: conv.convert(src, dst, progress=False))
        if cfg is None:
            assert leftovers(tmp_path, "out") == [], "a failed conversion left output behind"
        else:
            model = Transformer.from_pretrained(dst)  # a conversion that succeeded must load
            attempt(outcomes, "use", lambda: use_model(model))

    run()
    report("gguf", outcomes)


def test_fuzz_tokenizer(valid, tmp_path, bounded):
    spec = json.loads((valid / "tok" / "tokenizer.json").read_text())
    config = json.loads((valid / "tok" / "tokenizer_config.json").read_text())
    outcomes = Counter()

    @FUZZ
    @given(data=st.data())
    def run(data):
        d = tmp_path / "tok"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(valid / "tok", d)
        name, obj = data.draw(st.sampled_from([("tokenizer.json", spec)] * 3 + [("tokenizer_config.json", config)]))
        spoiled = json_bytes(data.draw(json_mutation(obj))) if data.draw(st.integers(0, 3)) else \
            data.draw(byte_mutation((d / name).read_bytes()))
        (d / name).write_bytes(spoiled)
        tok = attempt(outcomes, "load", lambda: load_tokenizer(d))
        if tok is not None:
            def use():
                ids = tok.encode("ab cd e abcd")
                tok.decode(ids)
                if tok.chat_template is not None:
                    tok.encode_chat([{"role": "user", "content": "ab"}])
            attempt(outcomes, "use", use)

    run()
    report("tokenizer", outcomes)


# ---------------------------------------------------------------------------------------------
# properties: a tokenizer.json's padding and truncation settings, saving into directories that are not empty

SIZES = [0, 1, 2, 3, 5, 8, 64, 10**9, 2**32 - 1, 2**64 - 1]  # what the tokenizers library reads as a usize


@st.composite
def padding_settings(draw):
    strategy = draw(st.sampled_from(["BatchLongest", "fixed"]))
    return {"strategy": {"Fixed": draw(st.sampled_from(SIZES))} if strategy == "fixed" else strategy,
            "direction": draw(st.sampled_from(["Left", "Right"])),
            "pad_to_multiple_of": draw(st.sampled_from([None, 1, 7, 64, 10**9])),
            "pad_id": draw(st.sampled_from([0, 2, 15, 16, 2**32 - 1])), "pad_type_id": draw(st.sampled_from([0, 1, 9])),
            "pad_token": draw(st.sampled_from(WORDS + ["[PAD]", ""]))}


@st.composite
def truncation_settings(draw):
    return {"direction": draw(st.sampled_from(["Left", "Right"])), "max_length": draw(st.sampled_from(SIZES)),
            "strategy": draw(st.sampled_from(["LongestFirst", "OnlyFirst", "OnlySecond"])),
            "stride": draw(st.sampled_from(SIZES))}


def test_fuzz_tokenizer_settings(valid, tmp_path, bounded):
    """transformers turns a tokenizer.json's padding and truncation off on every call: the same ids as without."""
    spec = json.loads((valid / "tok" / "tokenizer.json").read_text())
    plain = load_tokenizer(valid / "tok")
    texts = st.lists(st.sampled_from(WORDS[3:] + [" ", "  ", "<s>", "</s>", "x"]), max_size=12).map("".join)

    @FUZZ
    @given(padding=st.none() | padding_settings(), truncation=st.none() | truncation_settings(),
           text=texts, special=st.booleans())
    def run(padding, truncation, text, special):
        d = tmp_path / "tok"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(valid / "tok", d)
        (d / "tokenizer.json").write_text(json.dumps({**spec, "padding": padding, "truncation": truncation}))
        signal.setitimer(signal.ITIMER_REAL, SECONDS_PER_EXAMPLE)
        try:
            tok = load_tokenizer(d)
            ids = tok.encode(text, bos=special)
            assert ids == plain.encode(text, bos=special), (padding, truncation, text)
            assert tok.decode(ids) == plain.decode(ids)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    run()


FOREIGN_NAMES = ["notes.txt", ".hidden", "README.md", "config.json.bak", "model.safetensors.1", "d\u00fcnn.bin",
                 "sub/inner.txt", "sub/deeper/x", ".ckpt.old-x", "vocab.txt", *CHECKPOINT_FILES]


def test_fuzz_save_into_existing_directories(valid, tmp_path, bounded):
    models = {False: Transformer.from_pretrained(valid / "ckpt"), True: Transformer.from_pretrained(valid / "with_tok")}
    assert models[True].tokenizer is not None and models[False].tokenizer is None
    outcomes = Counter()

    @FUZZ
    @given(foreign=st.dictionaries(st.sampled_from(FOREIGN_NAMES), st.binary(max_size=64), max_size=6),
           older=st.sampled_from([None, False, True]), with_tok=st.booleans(), twice=st.booleans())
    def run(foreign, older, with_tok, twice):
        d = tmp_path / "ckpt"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        if older is not None:  # an older checkpoint already there, with or without a tokenizer
            models[older].save_pretrained(d)
        for name, content in foreign.items():
            (d / name).parent.mkdir(parents=True, exist_ok=True)
            (d / name).write_bytes(content)
        model = models[with_tok]
        signal.setitimer(signal.ITIMER_REAL, SECONDS_PER_EXAMPLE)
        try:
            for _ in range(2 if twice else 1):
                model.save_pretrained(d)
            loaded = Transformer.from_pretrained(d)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        kept = {n: c for n, c in foreign.items() if n not in CHECKPOINT_FILES}
        for name, content in kept.items():
            assert (d / name).read_bytes() == content, f"the foreign file {name} did not survive"
        assert (loaded.tokenizer is None) == (model.tokenizer is None)
        assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items())
        assert leftovers(tmp_path, "ckpt") == ["ckpt"], "a save left temporaries beside the directory"
        outcomes["with foreign files" if kept else "checkpoint files only"] += 1

    run()
    print(f"\nfuzz save paths: {dict(outcomes)}")
