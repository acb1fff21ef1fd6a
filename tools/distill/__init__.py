"""Distil a small draft model for speculative decoding from a target's own generations.

The stages (tools/distill_draft.py runs them; each resumes where it stopped):

1. generate (generation.py): the target answers the prompts of
   data/distill/prompts.jsonl (tools/distill_prompts.py; chat template
   applied), greedily and, for every `--sample-every`-th prompt, also sampled
   at T=0.7, since the draft must predict both. Continuous batching over the
   target's paged KV cache; finished sequences are appended to compact shards
   data/distill/gen-*.npz (uint16 token ids; committed), and a restart skips
   every (prompt, temperature) already in a shard. The target's top-k
   log-probabilities at every generated position come for free from the
   decode logits and are cached beside the shard under runs/distill/labels/
   (git-ignored, large); when they are missing (a fresh checkout), `train`
   recomputes them with one target forward pass per sequence (data.py).
2. train (training.py): a small `Transformer` (same class, same vocab, a
   subset lm_head over the most frequent target tokens; draft.py) learns from
   the target's soft labels (cross-entropy against the renormalised top-k
   distribution) plus the hard next token. Checkpoints (model + optimizer +
   data position + RNG; checkpoint.py) go to the run directory every few
   minutes; a restart resumes where it stopped, bit for bit.
3. export (draft.py): the run's latest weights -> a bf16 checkpoint with the
   target's tokenizer files, loadable with `Transformer.from_pretrained`.
4. measure (measure.py): on held-out prompts (never generated from), the
   greedy acceptance rate and tokens per round at k=4, from a teacher-forced
   replay and from `Transformer.speculate`, and the cost of one draft decode
   step relative to one target step (median of many, same thread count).

References: Hinton et al. 2015 (distillation); Leviathan et al. 2023 and
Chen et al. 2023 (speculative decoding); Zhou et al. 2023, DistillSpec
(distilling on the target's own generations, on-policy data helps acceptance).
"""

from .checkpoint import CKPT_NAME, draft_from_checkpoint, load_checkpoint, save_checkpoint
from .cli import main
from .common import DTYPES, TOPK, DataError
from .data import (
                   MANIFEST,
                   Example,
                   Shard,
                   check_data_target,
                   compute_labels,
                   item_key,
                   labels_path,
                   load_examples,
                   n_tokens,
                   shard_paths,
)
from .draft import build_draft, export_draft, make_draft_config
from .generation import ContinuousBatch, ShardWriter, generate_stage, shared_prefix, work_items
from .measure import heldout_prompts, measure_stage, simulate_greedy_rounds
from .training import OPTIM_FIELDS, StopRequest, TrainConfig, epoch_order, train_stage, wait_for_growth

__all__ = ["CKPT_NAME", "ContinuousBatch", "DTYPES", "DataError", "Example", "MANIFEST", "OPTIM_FIELDS", "Shard",
           "ShardWriter", "StopRequest", "TOPK", "TrainConfig", "build_draft", "check_data_target", "compute_labels",
           "draft_from_checkpoint", "epoch_order", "export_draft", "generate_stage", "heldout_prompts", "item_key",
           "labels_path", "load_checkpoint", "load_examples", "main", "make_draft_config", "measure_stage",
           "n_tokens", "save_checkpoint", "shard_paths", "shared_prefix", "simulate_greedy_rounds", "train_stage",
           "wait_for_growth", "work_items"]
