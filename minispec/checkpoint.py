"""Checkpoints: a directory with config.json, model.safetensors and, when there is one, the tokenizer.

Loading memory-maps the safetensors file (never pickle), checks every tensor
name and shape against the config and says which tensor is wrong. Saving is
atomic: the directory is written under a temporary name and renamed into place,
so an interrupted save never leaves a checkpoint that loads half-written.

`hf_to_minispec_name` is the one map from Hugging Face Llama-family tensor
names to minispec's; the converters reuse it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ModelConfig
from .tokenizer import TOKENIZER_FILES, load_tokenizer  # noqa: F401 (TOKENIZER_FILES: the converters' import)

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


class CheckpointError(ValueError):
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
            raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(shape)}, the config expects {expected[name]}")


def load_pretrained(cls, path, device=None, dtype: torch.dtype | None = None):
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    cfg = ModelConfig.load(str(path / CONFIG_NAME))
    wfile = path / WEIGHTS_NAME
    if not wfile.is_file():
        raise CheckpointError(f"{path}: no {WEIGHTS_NAME}")
    with torch.device("meta"):
        model = cls(cfg)
    expected = expected_shapes(model)
    try:
        with safe_open(str(wfile), framework="pt") as f:
            names = list(f.keys())
            shapes = {n: tuple(f.get_slice(n).get_shape()) for n in names}
            check_state_dict(shapes, expected, str(wfile))
            stored_dtype = f.get_slice("embed_tokens.weight").get_dtype()
            state = {n: f.get_tensor(n) for n in names}
    except CheckpointError:
        raise
    except Exception as e:  # truncated or corrupt file: safetensors' own error, with the file named
        raise CheckpointError(f"{wfile} cannot be read as safetensors ({type(e).__name__}: {e}); "
                              "the file may be truncated or corrupt: re-create or re-download it") from None
    if dtype is None:
        dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(stored_dtype, torch.float32)
    model.load_state_dict(state, assign=True, strict=True)  # meta parameters become the mmapped tensors
    model.init_rope()  # the RoPE tables were built on the meta device: build them for real
    model = model.to(device=device or "cpu", dtype=dtype)
    model.tokenizer = load_tokenizer(path)
    return model


def save_pretrained(model, path, dtype: torch.dtype | None = None) -> None:
    state = {k: v.detach().to("cpu", dtype=dtype if dtype is not None and v.is_floating_point() else v.dtype).contiguous()
             for k, v in model.state_dict().items()}
    with atomic_output_dir(path, overwrite=True) as tmp:
        model.config.save(str(tmp / CONFIG_NAME))
        save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt", "producer": "minispec"})
        tok = getattr(model, "tokenizer", None)
        if tok is not None:
            tok.save(tmp)


@contextlib.contextmanager
def atomic_output_dir(dst: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory beside `dst`; on success it becomes `dst`.

    On any exception the temporary directory is removed and `dst` is untouched
    (an existing `dst` is replaced only after the new one is complete).
    """
    dst = Path(dst)
    if dst.exists() and not overwrite:
        raise FileExistsError(f"{dst} already exists; choose another output directory or pass --overwrite")
    parent = dst.parent if str(dst.parent) else Path(".")
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes the directory private; a checkpoint is meant to be shared
    try:
        yield tmp
        for f in tmp.iterdir():  # some writers (safetensors) create files private to their owner
            os.chmod(f, 0o644)
        old = None
        if dst.exists():
            old = parent / f".{dst.name}.old-{os.getpid()}"
            os.replace(dst, old)
        os.replace(tmp, dst)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
