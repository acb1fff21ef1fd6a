"""Checkpoints: a directory with config.json, model.safetensors and, when there is one, the tokenizer.

Loading memory-maps the safetensors file (never pickle) and checks it against
the config before building anything: the layer count first (a config.json that
claims 10**9 layers is refused at once, not built), then every tensor name,
shape and dtype, saying which tensor is wrong; memory is bounded by what the
file holds. The tokenizer must fit the model's vocabulary.

Saving is atomic: the files are written into a temporary directory beside the
destination and put in place only when complete, so an interrupted save never
leaves a checkpoint that loads half-written. A new directory, or one that holds
nothing but a checkpoint's own files, is replaced whole by a rename. A directory
that also holds other files (notes, a README, a Hugging Face checkpoint) keeps
them: the complete new set is renamed to `.DST.new-HOST-PID` beside it (the
commit), then each file is renamed into place, and a kill during those renames
is completed by the next save to, or load from, DST. Only a checkpoint's own file
names (CHECKPOINT_FILES) are replaced or removed; a regular file or "." as the
destination is refused. The temporaries are named after the host and process
that wrote them, so the next write to the same destination removes those of dead
processes, and restores the old checkpoint when a kill came between the two
renames of an overwrite.

`hf_to_minispec_name` is the one map from Hugging Face Llama-family tensor
names to minispec's; the converters reuse it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from . import forms, quantized
from .config import ModelConfig
from .errors import InputError
from .forms import int4_supported
from .tokenizer import TOKENIZER_FILES, load_tokenizer  # noqa: F401 (TOKENIZER_FILES: the converters' import)

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
# the file names a checkpoint is made of: a save replaces (or removes) these in its destination, never other files
CHECKPOINT_FILES = (CONFIG_NAME, WEIGHTS_NAME, *TOKENIZER_FILES)
_MANIFEST = ".minispec-files.json"  # in a committed `.new-` set: the files to move into place and those to remove
# safetensors dtype tag -> torch dtype, for the weights minispec computes with; head_ids (a subset head's ids) is I64
WEIGHT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_LAYER = re.compile(r"^layers\.(\d{1,9})\.")  # a longer index is no layer of any real model: an unexpected tensor


class CheckpointError(InputError):
    """A checkpoint is missing, corrupt, or does not match its config."""


_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_LAYER_PARTS = {
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
}


def hf_to_minispec_name(name: str) -> str | None:
    """Hugging Face Llama/Mistral/Qwen2 tensor name -> minispec name; None for tensors minispec does not use.

    minispec's module names are Hugging Face's without the "model." prefix.
    """
    if name in ("model.embed_tokens.weight", "model.norm.weight"):
        return name[len("model."):]
    if name == "lm_head.weight":
        return name
    m = _HF_LAYER.match(name)
    if m and m.group(2) in _HF_LAYER_PARTS:
        return f"layers.{m.group(1)}.{m.group(2)}"
    if name.endswith("rotary_emb.inv_freq"):
        return None  # a cached buffer some checkpoints carry; minispec rebuilds it from the config
    raise CheckpointError(f"unexpected tensor {name!r} in a Hugging Face Llama-family checkpoint")


def minispec_to_hf_name(name: str) -> str:
    return name if name == "lm_head.weight" else "model." + name


def expected_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def expected_tensors(cls, cfg: ModelConfig, shapes: dict[str, tuple[int, ...]],
                     source: str) -> dict[str, tuple[int, ...]]:
    """The tensor names and shapes a checkpoint of `cfg` holds, found without building cfg.n_layers layers.

    `shapes` are the file's tensors (from its header). A one-layer model of `cls` on the meta device
    gives the shapes (no memory); the config's layer count is compared with the file's before that
    layer's names are repeated n_layers times, so a config that claims more layers than the file
    holds (10**9) is refused before any work proportional to its claim.
    """
    with torch.device("meta"):
        one = expected_shapes(cls(dataclasses.replace(cfg, n_layers=1)))
    parts = sorted(name[len("layers.0."):] for name in one if name.startswith("layers.0."))
    out = {name: shape for name, shape in one.items() if not name.startswith("layers.0.")}
    if len(out) + cfg.n_layers * len(parts) > len(shapes):
        # fewer tensors than the config needs: name the missing ones from the file's names alone, so a config that
        # claims 900,000 layers over a file of tiny tensors is refused before its name set is built
        held = {int(m.group(1)) for n in shapes if (m := _LAYER.match(n))}
        missing = [n for n in out if n not in shapes]
        for i in range(min(cfg.n_layers, len(held) + 1)):  # some layer in this range lacks a tensor (pigeonhole)
            missing += [f"layers.{i}.{p}" for p in parts if f"layers.{i}.{p}" not in shapes]
            if missing:
                break
        raise CheckpointError(f"{source}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}: the "
                              f"config has n_layers={cfg.n_layers}, the weights hold {len(held)} layer(s) and "
                              f"{len(shapes)} tensor(s), {len(out) + cfg.n_layers * len(parts)} expected "
                              "(does config.json match the weights?)")
    for i in range(cfg.n_layers):
        out.update({f"layers.{i}.{p}": one[f"layers.0.{p}"] for p in parts})
    return out


def check_dtypes(dtypes: dict[str, str], source: str) -> None:
    """Every weight must be F32, BF16 or F16 and head_ids I64: an I32, BOOL or F8 weight is named, not loaded."""
    for name, dt in dtypes.items():
        want = ("I64",) if name == "head_ids" else tuple(WEIGHT_DTYPES)
        if dt not in want:
            raise CheckpointError(f"{source}: tensor {name!r} has dtype {dt}; minispec reads {'/'.join(want)} there "
                                  "(re-save or re-convert the checkpoint with --dtype float32, bfloat16 or float16)")


def check_head_ids(head_ids: torch.Tensor, vocab_size: int, source: str) -> None:
    """A subset head's ids must be distinct token ids: an id out of range or twice would score the wrong tokens."""
    ids = head_ids.tolist()
    if any(not 0 <= i < vocab_size for i in ids) or len(set(ids)) != len(ids):
        raise CheckpointError(f"{source}: head_ids must be distinct token ids in [0, {vocab_size}); the file's are not")


def check_state_dict(shapes: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], source: str) -> None:
    """Raise CheckpointError naming every missing or unexpected tensor and the first shape mismatch."""
    missing = sorted(set(expected) - set(shapes))
    extra = sorted(set(shapes) - set(expected))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if extra:
            parts.append(f"unexpected tensor(s) {extra[:5]}{' ...' if len(extra) > 5 else ''}")
        raise CheckpointError(f"{source}: {'; '.join(parts)} (does config.json match the weights?)")
    for name, shape in shapes.items():
        if tuple(shape) != expected[name]:
            raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(shape)}, "
                                  f"the config expects {expected[name]}")


def limit_to_tokenizer(cfg: ModelConfig, tokenizer) -> ModelConfig:
    """Sample only ids the tokenizer has: rows past its largest id pad the embedding (Qwen2: 151,936 rows for
    151,665 tokens), no text maps to them, so a config that does not say otherwise gets sampled_vocab_size set
    (in place; returned). The config a checkpoint loads with, for anyone who reads config.json directly."""
    if tokenizer is not None and cfg.sampled_vocab_size is None and tokenizer.max_id + 1 < cfg.vocab_size:
        cfg.sampled_vocab_size = tokenizer.max_id + 1
    return cfg


def _check_directory(path: Path) -> None:
    """A checkpoint directory that exists, an interrupted save into it completed first."""
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a checkpoint directory (config.json, model.safetensors, ...)")
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist{_interrupted_hint(path)}")
    try:
        _finish_committed(path)
    except OSError as e:  # a read-only copy: the interrupted save cannot be completed from here
        raise CheckpointError(f"{path}: a save into it was interrupted and cannot be completed ({e}); its files may "
                              "mix two checkpoints: save it again") from None


def _read_weights(cls, cfg: ModelConfig, wfile: Path) -> tuple[dict, dict, dict]:
    """The weights file's tensors checked against the config: (each tensor's dtype, the kept matrices
    (quantized.split_kept), every tensor but a kept matrix's parts), a CheckpointError naming the file else."""
    try:
        with safe_open(str(wfile), framework="pt") as f:
            names = list(f.keys())
            shapes = {n: tuple(f.get_slice(n).get_shape()) for n in names}
            dtypes = {n: f.get_slice(n).get_dtype() for n in names}
            shapes, kept = quantized.split_kept(shapes, dtypes, str(wfile))  # a kept matrix under its own name
            check_state_dict(shapes, expected_tensors(cls, cfg, shapes, str(wfile)), str(wfile))
            check_dtypes({n: dt for n, dt in dtypes.items() if n in shapes}, str(wfile))
            # a kept matrix's parts are read when it is packed (load_pretrained), one matrix at a time, not here
            parts = quantized.part_names(kept)
            return dtypes, kept, {n: f.get_tensor(n) for n in names if n not in parts}
    except CheckpointError:
        raise
    except quantized.QuantizedCheckpointError as e:
        raise CheckpointError(str(e)) from None
    except Exception as e:  # truncated or corrupt file: safetensors' own error, with the file named
        raise CheckpointError(f"{wfile} cannot be read as safetensors ({type(e).__name__}: {e}); "
                              "the file may be truncated or corrupt: re-create or re-download it") from None


def load_pretrained(cls, path, device=None, dtype: torch.dtype | None = None, int4: bool | None = None):
    """A checkpoint directory as a model on `device` (default the CPU), in `dtype` (default as stored).
    int4: the products in int4 (Transformer.to_int4), True or False; None = as config.json's int4 says, on a CPU
    with the kernel (elsewhere the stored dtype). An int4 model computes its activations in fp32.

    A checkpoint that keeps a GGUF's quantization (minispec.quantized) computes in that form on a CPU with the
    kernels (int4 None or True, dtype None or float32); otherwise (another device, int4=False, another dtype)
    its weights are dequantized to `dtype` (default float32)."""
    path = Path(path)
    _check_directory(path)
    cfg = ModelConfig.load(str(path / CONFIG_NAME))
    wfile = path / WEIGHTS_NAME
    if not wfile.is_file():
        raise CheckpointError(f"{path}: no {WEIGHTS_NAME}")
    dtypes, kept, state = _read_weights(cls, cfg, wfile)
    if "head_ids" in state:
        check_head_ids(state["head_ids"], cfg.vocab_size, str(wfile))
    tokenizer = load_tokenizer(path)
    if tokenizer is not None:
        check_tokenizer(tokenizer, cfg, str(path))
        limit_to_tokenizer(cfg, tokenizer)
    packed = bool(kept) and int4 is not False and dtype in (None, torch.float32) and int4_supported(device or "cpu")
    if kept and int4 and not packed:
        raise ValueError("a kept quantization computes as stored only on a CPU with PyTorch's int4 kernel, in "
                         f"float32 activations (device {device or 'cpu'}, dtype {dtype}); pass int4=False to "
                         "dequantize it")
    if int4 is None:
        int4 = cfg.int4 and not kept and dtype in (None, torch.float32) and int4_supported(device or "cpu")
    if int4 and dtype not in (None, torch.float32):
        raise ValueError(f"an int4 model computes its activations in float32, not {dtype}")
    if dtype is None:
        dtype = torch.float32 if int4 or kept else WEIGHT_DTYPES[dtypes["embed_tokens.weight"]]
    with torch.device("meta"):  # checked against the file: a model of the file's size, no memory yet
        model = cls(cfg)
    if kept:  # a kept matrix's parts are read (and their scales checked) here: an error names the file
        try:
            with quantized.FileReader(wfile) as read:
                if packed:
                    forms.install(model, kept, read, state)
                else:
                    state.update(quantized.dequantized(kept, read))
        except quantized.QuantizedCheckpointError as e:
            raise CheckpointError(f"{wfile}: {e}") from None
    if packed:
        state = {n: t.clone() for n, t in state.items()}  # the norms and biases: none keeps the file mapped
    model.load_state_dict(state, assign=True, strict=True)  # meta parameters become the mmapped tensors
    model.init_rope()  # the RoPE tables were made on the meta device: make them real (they grow with use)
    model.config.int4 = False  # set again by to_int4
    model = model.to(device=device or "cpu", dtype=None if int4 else dtype)  # int4: each matrix in fp32 only in turn
    if packed:
        forms.make_rows_alike(model)
    elif int4:
        model.to_int4()
    model.tokenizer = tokenizer
    return model


def check_tokenizer(tokenizer, cfg: ModelConfig, source: str) -> None:
    """The tokenizer must fit the model: no id past the embedding, and the config's special ids in its vocabulary.

    A model's vocabulary may be larger than its tokenizer's (padded to a multiple of 64 or 128, as in
    Qwen2), never smaller: the tokenizer would produce ids the model has no embedding for. What counts
    is the largest id, not the number of tokens (a tokenizer.json's ids may have gaps).
    """
    if tokenizer.max_id >= cfg.vocab_size:
        what = (f"has {tokenizer.vocab_size} tokens, more than" if tokenizer.max_id + 1 == tokenizer.vocab_size
                else f"has token id {tokenizer.max_id}, past")
        raise CheckpointError(f"{source}: the tokenizer {what} the model's vocab_size={cfg.vocab_size}; the tokenizer "
                              "files belong to another model")
    for name, ids in (("eos_id", cfg.stop_ids), ("bos_id", () if cfg.bos_id is None else (cfg.bos_id,))):
        for i in ids:
            if i > tokenizer.max_id or tokenizer.id_to_token(i) is None:
                raise CheckpointError(f"{source}: config.json's {name} {i} is not in the tokenizer's vocabulary of "
                                      f"{tokenizer.vocab_size} tokens; the tokenizer files belong to another model")


def save_pretrained(model, path, dtype: torch.dtype | None = None, overwrite: bool = True) -> None:
    """Write `model` (config.json, model.safetensors, its tokenizer's files) into the directory `path`.

    Other files in `path` are kept; a checkpoint's own files there are replaced as a set (atomic_output_dir).
    overwrite=False refuses a `path` that is not empty.
    """
    if forms.is_packed(model):
        raise ValueError("a model with packed weights (int4 products or a GGUF's kept quantization) is not saved: "
                         "save the float checkpoint it came from, with int4 set in its config.json "
                         "(tools/convert_gguf.py --int4), or convert its GGUF again (--keep-quant)")
    state = {k: v.detach().to("cpu", dtype=dtype if dtype is not None and v.is_floating_point() else v.dtype)
             .contiguous() for k, v in model.state_dict().items()}
    with atomic_output_dir(path, overwrite=overwrite) as tmp:
        model.config.save(str(tmp / CONFIG_NAME))
        save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt", "producer": "minispec"})
        tok = getattr(model, "tokenizer", None)
        if tok is not None:
            tok.save(tmp)


def _host() -> str:
    """This machine's name as it goes into a temporary's name (a shared filesystem sees several machines)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"


def _leftover(parent: Path, dst_name: str) -> Iterator[tuple[Path, str, int]]:
    """(path, kind "tmp", "new" or "old", pid) of each temporary a write to `dst_name` left beside it on this host."""
    pattern = re.compile(rf"^\.{re.escape(dst_name)}\.(tmp|new|old)-{re.escape(_host())}-(\d+)(?:-.*)?$")
    for p in parent.iterdir() if parent.is_dir() else ():
        m = pattern.match(p.name)
        if m:
            yield p, m.group(1), int(m.group(2))


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    except OverflowError:
        return False
    return True


def recover_output_dir(dst: str | os.PathLike) -> None:
    """Finish or remove what writes to `dst` by dead processes of this host left, restoring `dst` if it went missing.

    A kill during a write leaves `.DST.tmp-HOST-PID-*` (the new checkpoint, maybe partial): removed.
    A kill while a committed set `.DST.new-HOST-PID-*` was being moved into DST: the moves are completed.
    A kill between the two renames of an overwrite leaves no DST and the complete old one as
    `.DST.old-HOST-PID`: renamed back to DST (the newest, if several). A live process's temporaries
    are left alone.
    """
    dst = Path(dst)
    _finish_committed(dst)
    stale = [(p, kind) for p, kind, pid in _leftover(dst.parent, dst.name) if not _alive(pid) and kind != "new"]
    olds = sorted((p for p, kind in stale if kind == "old"), key=lambda p: p.stat().st_mtime)
    if olds and not dst.exists():
        os.replace(olds.pop(), dst)
    for p, _ in stale:
        if p.exists():
            shutil.rmtree(p, ignore_errors=True)


def _finish_committed(dst: Path) -> None:
    """Complete the moves of each committed set (`.DST.new-*`) a dead process left beside `dst`."""
    for new, kind, pid in list(_leftover(dst.parent, dst.name)):
        if kind == "new" and not _alive(pid) and dst.is_dir():
            _move_set(new, dst)


def _move_set(new: Path, dst: Path) -> None:
    """Rename a committed set's files into `dst`, remove the checkpoint names it lacks there, then the set itself.

    Safe to repeat after a kill: the manifest lists every file of the set, and those already moved are skipped.
    """
    try:
        manifest = json.loads((new / _MANIFEST).read_text(encoding="utf-8"))
        write, remove = list(manifest["write"]), list(manifest["remove"])
        if not all(isinstance(n, str) and n and Path(n).name == n for n in write + remove):
            raise ValueError("a name in the manifest is not a plain file name")
    except (OSError, ValueError, KeyError, TypeError):  # not a set this module committed: a stale temporary
        shutil.rmtree(new, ignore_errors=True)
        return
    for name in write:
        if (new / name).exists():
            _move_file(new / name, dst / name)
    for name in remove:
        if (dst / name).is_file() or (dst / name).is_symlink():
            (dst / name).unlink()
    shutil.rmtree(new, ignore_errors=True)


def _move_file(src: Path, dst: Path) -> None:
    """Rename `src` onto `dst`; across file systems (DST a mount point), copy to a temporary beside `dst` first."""
    try:
        os.replace(src, dst)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        tmp = dst.with_name(f".{dst.name}.tmp-{_host()}-{os.getpid()}")
        try:
            shutil.copyfile(src, tmp)
            os.chmod(tmp, 0o644)
            os.replace(tmp, dst)
        finally:
            tmp.unlink(missing_ok=True)
        src.unlink()


def check_output_dir(dst: str | os.PathLike, overwrite: bool = False) -> Path:
    """`dst` as a Path if a checkpoint can be written there; refused before any work otherwise.

    A regular file, "." or ".." (no directory name to write beside) is a CheckpointError; an existing
    directory that is not empty is a FileExistsError unless `overwrite` (an empty one is used as it is).
    """
    dst = Path(dst)
    if dst.name in ("", ".", ".."):
        raise CheckpointError(f"{str(dst)!r} cannot be the output directory: name a directory by its own name "
                              "(e.g. ./checkpoint), not the current or the parent directory")
    if dst.exists() and not dst.is_dir():
        raise CheckpointError(f"{dst} is a file, not a directory; choose another output directory")
    if not overwrite and dst.is_dir() and any(dst.iterdir()):
        raise FileExistsError(f"{dst} already exists; choose another output directory or pass --overwrite")
    return dst


def _interrupted_hint(dst: Path) -> str:
    """For a missing checkpoint directory: a note when an interrupted overwrite left the old one beside it."""
    if any(kind == "old" for _, kind, _ in _leftover(dst.parent, dst.name)):
        return (f" (an overwrite of it was interrupted; the old checkpoint is in .{dst.name}.old-* beside it, and "
                "the next save or conversion to this path restores it first)")
    return ""


@contextlib.contextmanager
def atomic_output_dir(dst: str | os.PathLike, overwrite: bool = False,
                      owned: tuple[str, ...] = CHECKPOINT_FILES) -> Iterator[Path]:
    """Yield a fresh temporary directory beside `dst`; on success its files are in `dst`.

    A `dst` that does not exist, or holds nothing but files the new set replaces (the names written
    and the `owned` names), is replaced whole by renames. Any other `dst` keeps its other files: the
    complete new set is committed beside it and its files renamed in one by one (see the module
    docstring); the `owned` names the new set lacks are removed there, so no file of an older
    checkpoint mixes with the new one. On any exception the temporary directory is removed and `dst`
    is untouched. Leftovers of earlier writes to `dst` by dead processes are dealt with first
    (recover_output_dir); check_output_dir says which destinations are refused.
    """
    dst = Path(dst)
    if dst.name not in ("", ".", ".."):
        recover_output_dir(dst)
    check_output_dir(dst, overwrite)
    parent = dst.parent if str(dst.parent) else Path(".")
    parent.mkdir(parents=True, exist_ok=True)
    tag = f"{_host()}-{os.getpid()}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-{tag}-", dir=parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes the directory private; a checkpoint is meant to be shared
    try:
        yield tmp
        written = sorted(f.name for f in tmp.iterdir())
        for name in written:  # some writers (safetensors) create files private to their owner
            os.chmod(tmp / name, 0o644)
        replaced = set(written) | {n for n in owned if (dst / n).is_file()}
        if dst.is_dir() and (dst.is_symlink() or os.path.ismount(dst) or any(p.name not in replaced
                                                                              for p in dst.iterdir())):
            # other files live in dst: commit the set beside it, then move its files in (_move_set)
            (tmp / _MANIFEST).write_text(json.dumps({"write": written, "remove": sorted(set(owned) - set(written))}),
                                         encoding="utf-8")
            new = parent / f".{dst.name}.new-{tmp.name[len(f'.{dst.name}.tmp-'):]}"
            os.replace(tmp, new)
            _move_set(new, dst)
            return
        old = None
        if dst.exists():
            old = parent / f".{dst.name}.old-{tag}"
            os.replace(dst, old)
        os.replace(tmp, dst)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
