"""`load_draft`: any draft directory the project writes, as what `speculate` takes, checked against its target.

Three kinds: a Transformer checkpoint (a smaller model of the target's family, e.g. the int4 0.5B), the same
with a subset head (tools/draft_head.py; still a Transformer checkpoint, its config saying head_vocab_size),
and a feature draft (minispec.feature_draft; config.json's "kind" says so), which comes back as a
FeatureDrafter bound to the target, since it reads the target's embedding and hidden states.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import CheckpointError
from .config import DTYPES, ModelConfig, read_json
from .errors import check_compatible, one_line
from .feature_draft import KIND, FeatureDraft, FeatureDrafter, check_feature_draft
from .model import Transformer

FORMS = (*DTYPES, "int4")  # what `dtype` may name: a compute dtype, or int4 products on a CPU


def load_draft(path, target, dtype: str | None = None, device=None):
    """The draft at `path` for `target`: a Transformer, or a FeatureDrafter; refused in one line (a
    GenerationError or CheckpointError) when it was made for another target (tokenizer, width, vocabulary).

    dtype: a DTYPES name, "int4" (int4 products, on a CPU), or None: as its config.json says (int4 on a CPU
    where it says so), else as stored, except that a bfloat16 draft computes in the target's dtype on a CPU,
    where bf16 has no fast kernels on most machines (docs/benchmarks.md, "bf16 target"). The output stays the
    target's whatever the draft's form."""
    path = Path(path)
    if dtype is not None and dtype not in FORMS:
        raise CheckpointError(f"draft dtype must be one of {', '.join(FORMS)}, got {dtype!r}")
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
    against its config before they are loaded. fp32 unless `dtype` says otherwise ("int4" on a CPU)."""
    from safetensors.torch import load_file

    check_feature_draft(config, target, str(path))
    try:
        layer = ModelConfig.from_dict(config["layer"], source=f"{path / 'config.json'} (layer)")
        with torch.device("meta"):
            expected = {k: tuple(v.shape) for k, v in FeatureDraft(layer, config["target_dim"]).state_dict().items()}
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: not a usable feature draft config ({one_line(e)})") from None
    try:
        tensors = load_file(str(path / "model.safetensors"))
    except (OSError, RuntimeError, ValueError) as e:  # missing, truncated, not safetensors
        raise CheckpointError(f"{path}/model.safetensors cannot be read ({one_line(e)})") from None
    wrong = sorted(set(expected) ^ set(tensors)) or [k for k in expected if tuple(tensors[k].shape) != expected[k]]
    if wrong:
        raise CheckpointError(f"{path}: model.safetensors does not match its config.json (e.g. {wrong[0]})")
    if int(tensors["head_ids"].min()) < 0 or int(tensors["head_ids"].max()) >= layer.vocab_size:
        raise CheckpointError(f"{path}: its draft vocabulary holds ids outside [0, {layer.vocab_size})")
    draft = FeatureDraft(layer, config["target_dim"])
    draft.load_state_dict(tensors)
    float_dtype = DTYPES[dtype] if dtype in DTYPES else torch.float32
    draft = draft.to(device=device or target.device, dtype=float_dtype)
    if dtype == "int4" or (dtype is None and config.get("int4") and draft.device.type == "cpu"):
        draft.to_int4()
    return draft
