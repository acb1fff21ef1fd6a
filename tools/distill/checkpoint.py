"""A training run's checkpoint, RUN/ckpt.pt: written atomically, read only with `torch.load(weights_only=True)`.

It holds tensors, numbers, strings, booleans, None, and lists, tuples and
dicts of them: the draft's and the optimizer's state dicts, the RNG state (a
uint8 tensor), the configs as dicts and the position in the epoch. That is
all weights_only loading accepts, so a checkpoint holding anything else (a
pickled object whose __reduce__ would run code, say) is refused with a
`CheckpointError` and nothing in it runs.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import torch

from minispec import CheckpointError, ModelConfig, Transformer
from minispec.errors import one_line

CKPT_NAME = "ckpt.pt"
TYPES = {"model": dict, "optimizer": dict, "step": int, "epoch": int, "order": (list, type(None)), "pos": int,
         "best": (float, int), "rng": torch.Tensor, "model_config": dict, "train_config": dict}  # what ckpt.pt holds
KEYS = tuple(TYPES)


def save_checkpoint(path: Path, state: dict) -> None:
    """Write `state` (only what weights_only loading accepts) to `path`, replacing the old one only when complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # an interrupted save leaves the previous checkpoint intact


def unusable(path: Path, why: str) -> CheckpointError:
    """The error for a checkpoint that cannot be used: what is wrong, and what to do."""
    return CheckpointError(f"{path}: {why}; delete it and train again")


def load_checkpoint(path: str | Path) -> dict:
    """The state a training run saved at `path`, loaded with weights_only=True and checked for its keys."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no training checkpoint there; run `python tools/distill_draft.py train` first")
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols of files it then refuses anyway
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a damaged file raises anything: UnpicklingError, RuntimeError, EOFError, IndexError...
        found = re.search(r"GLOBAL (\S+) was not an allowed global", str(e))  # torch names what it refused
        if found:
            raise unusable(path, f"holds a Python object ({found[1]}) other than tensors, numbers, strings and "
                                  "containers, so it is not loaded (unpickling it could run code)") from None
        raise unusable(path, f"not a readable training checkpoint ({type(e).__name__}; only what "
                              "torch.load(weights_only=True) accepts is read)") from None
    missing = [k for k in KEYS if k not in state] if isinstance(state, dict) else list(KEYS)
    if missing:
        raise unusable(path, f"not a training checkpoint of this tool (missing {missing})")
    wrong = [k for k, t in TYPES.items() if not isinstance(state[k], t)]
    if wrong:
        raise unusable(path, f"not a training checkpoint of this tool ({', '.join(wrong)} of the wrong type)")
    return state


def draft_from_checkpoint(state: dict, path: str | Path) -> Transformer:
    """The draft a loaded checkpoint holds. Its config is checked against the stored tensors' shapes (on the
    meta device, which allocates nothing) before the draft is built: an absurd config fails at once."""
    weights = state["model"]
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise unusable(path, "its model entry is not a dict of tensors")
    try:
        config = ModelConfig.from_dict(state["model_config"], source=f"{path} (model_config)")
        if not 0 < config.n_layers <= len(weights):  # checked before any layer is built, even on meta
            raise ValueError(f"{config.n_layers} layers for {len(weights)} tensors")
        with torch.device("meta"):
            expected = {k: tuple(v.shape) for k, v in Transformer(config).state_dict().items()}
    except (ValueError, TypeError, RuntimeError, OverflowError) as e:  # RuntimeError: torch's size overflow on meta
        raise unusable(path, f"its model_config cannot be used ({one_line(e)})") from None
    wrong = sorted(set(expected) ^ set(weights)) or [k for k in expected if tuple(weights[k].shape) != expected[k]]
    if wrong:
        raise unusable(path, f"its model_config does not match the tensors it holds (e.g. {wrong[0]})")
    draft = Transformer(config)
    draft.load_state_dict(weights)
    return draft
