"""`load_draft`: any draft directory the project writes, as what `speculate` takes, checked against its target.

Three kinds: a Transformer checkpoint (a smaller model of the target's family, e.g. the int4 0.5B), the same
with a subset head (tools/draft_head.py; still a Transformer checkpoint, its config saying head_vocab_size),
and a feature draft (minispec.feature_draft; config.json's "kind" says so), which comes back as a
FeatureDrafter bound to the target, since it reads the target's embedding and hidden states.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from . import ggml
from .checkpoint import CheckpointError, check_head_ids
from .config import DTYPES, ModelConfig, read_json
from .errors import check_compatible, one_line, show
from .feature_draft import KIND, FeatureDraft, FeatureDrafter, check_feature_draft
from .model import Transformer

DRAFT_DTYPES = (*DTYPES, "int4")  # what `dtype` may name: a compute dtype, or int4 products on a CPU
HEADER_BYTES = 1 << 20  # room for a feature draft's safetensors header (a few KB: about 15 tensors)


def load_draft(path, target, dtype: str | None = None, device=None):
    """The draft at `path` for `target`: a Transformer, or a FeatureDrafter; refused in one line (a
    GenerationError or CheckpointError) when it was made for another target (tokenizer, width, vocabulary).

    dtype: a DTYPES name, "int4" (int4 products, on a CPU), or None: as its config.json says (int4 on a CPU
    where it says so), else as stored, except that a bfloat16 draft computes in the target's dtype on a CPU,
    where bf16 has no fast kernels on most machines (docs/benchmarks.md, "bf16 target"), and that a feature draft
    on a CPU with a built product library computes its products as Q8_0 blocks through it (`FeatureDraft.to_blocks`;
    a dtype given keeps it float). The output stays the target's whatever the draft's form."""
    if not isinstance(path, (str, os.PathLike)):
        raise CheckpointError(f"a draft is a directory path (a str or os.PathLike), got {show(path)}")
    path = Path(path)
    if dtype is not None and dtype not in DRAFT_DTYPES:
        raise CheckpointError(f"draft dtype must be one of {', '.join(DRAFT_DTYPES)}, got {dtype!r}")
    if dtype == "int4" and torch.device(device or "cpu").type != "cpu":
        raise CheckpointError(f"int4 draft products run on a CPU, not {device}")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} is not a draft directory (no config.json)")
    config = read_json(path / "config.json")
    if config.get("kind") == KIND:
        return FeatureDrafter(load_feature_draft(path, target, config, dtype, device), target)
    if dtype == "int4":
        draft = Transformer.from_pretrained(path, device=device, int4=True)
    else:
        draft = Transformer.from_pretrained(path, device=device, dtype=DTYPES[dtype] if dtype else None,
                                            int4=False if dtype else None)
        if dtype is None and draft.dtype == torch.bfloat16 and draft.device.type == "cpu":
            draft = draft.to(target.dtype)
    check_compatible(target, draft)
    return draft


def load_feature_draft(path: Path, target, config: dict, dtype: str | None = None, device=None) -> FeatureDraft:
    """A feature draft's module, checked against the target before anything is built, its tensors checked
    against its config before they are loaded. fp32 unless `dtype` says otherwise ("int4" on a CPU); given no dtype,
    on a CPU where a product library is built, its products in Q8_0 blocks (`FeatureDraft.to_blocks`)."""
    from safetensors import SafetensorError, safe_open

    check_feature_draft(config, target, str(path))
    try:
        layer = ModelConfig.from_dict(config["layer"], source=f"{path / 'config.json'} (layer)")
        with torch.device("meta"):
            expected = {k: tuple(v.shape) for k, v in FeatureDraft(layer, config["target_dim"]).state_dict().items()}
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: not a usable feature draft config ({one_line(e)})") from None
    wfile = path / "model.safetensors"
    # safetensors maps the whole file: one larger than this config's tensors could fill (a 50 GB sparse file) is
    # refused before it is mapped; the header is checked against the file's size by safetensors and against the
    # config below, before any tensor is read
    most = HEADER_BYTES + 8 * sum(math.prod(shape) for shape in expected.values())
    size = wfile.stat().st_size if wfile.is_file() else None
    if size is not None and size > most:
        raise CheckpointError(f"{wfile} is {size} bytes, more than the {most} its config.json's tensors can take: "
                              "not this draft's weights")
    try:
        with safe_open(str(wfile), framework="pt") as f:
            shapes = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
            wrong = sorted(set(expected) ^ set(shapes)) or [k for k in expected if shapes[k] != expected[k]]
            if wrong:
                k = wrong[0]
                raise CheckpointError(f"{path}: model.safetensors does not match its config.json (e.g. {k}: "
                                      f"{shapes.get(k, 'absent')} in the file, {expected.get(k, 'absent')} by the "
                                      "config)")
            tensors = {n: f.get_tensor(n) for n in shapes}
    except CheckpointError:
        raise
    except (OSError, RuntimeError, ValueError, SafetensorError) as e:  # missing, empty, truncated, not safetensors
        raise CheckpointError(f"{wfile} cannot be read ({one_line(e)})") from None
    check_head_ids(tensors["head_ids"], layer.vocab_size, str(wfile))
    draft = FeatureDraft(layer, config["target_dim"])
    draft.load_state_dict(tensors)
    float_dtype = DTYPES[dtype] if dtype in DTYPES else torch.float32
    draft = draft.to(device=device or target.device, dtype=float_dtype)
    if dtype == "int4" or (dtype is None and config.get("int4") and draft.device.type == "cpu"):
        draft.to_int4()
    elif dtype is None and draft.device.type == "cpu" and ggml.available():
        draft.to_blocks()  # Q8_0 through the compiled product: a quarter of fp32's bytes a draft step
    return draft
