"""What every stage of the distiller shares: default paths, the soft-label width, the target's dtypes, logging."""

from __future__ import annotations

import os
import sys
import time

import torch

from minispec.config import DTYPES as DTYPES_ALL

TARGET = "weights/smollm2-135m-instruct"
DATA = "data/distill"
PROMPTS = "data/distill/prompts.jsonl"
LABELS = "runs/distill/labels"
RUN = "runs/distill/main"
DRAFT_OUT = "weights/smollm2-135m-draft"
TOPK = 32  # soft labels kept per position
# --target-dtype: bfloat16 runs the target faster where the CPU has native bf16 matrix products, at the cost of
# a few argmax flips against float32 (docs/benchmarks.md, "bf16 target")
# the target dtypes distillation runs in (a subset of minispec.config.DTYPES: fp16 training is not supported)
DTYPES = {name: DTYPES_ALL[name] for name in ("float32", "bfloat16")}


class DataError(ValueError):
    """A shard, soft-label file or data directory that cannot be used as it is (the message says what to do)."""


def log(msg: str) -> None:
    """A timestamped line on stderr (stdout stays free for `measure`'s JSON)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def set_threads(n: int) -> None:
    """Use n CPU threads, in torch and in any OpenMP library loaded later."""
    torch.set_num_threads(n)
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
