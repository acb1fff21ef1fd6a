"""The distiller's data on disk: shards of target text, their soft labels, and the examples training reads.

- data/distill/gen-*.npz (committed): finished sequences, prompt and response
  ids as uint16, one shard written whole per flush (`Shard`).
- data/distill/target.json: the target whose text the shards hold; a data
  directory never mixes two targets (`check_data_target`).
- runs/distill/labels/gen-*.labels.npz (large, not committed): the target's
  top-k log-probabilities at every response position of a shard.

Every file is read with numpy's allow_pickle=False: a shard or label file
holding pickled objects is refused with a `DataError`, never unpickled.
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from minispec import ModelConfig, Transformer
from minispec.checkpoint import limit_to_tokenizer
from minispec.tokenizer import load_tokenizer

from .common import TARGET, TOPK, DataError, log

MANIFEST = "target.json"


def read_arrays(path: Path, fields: tuple[str, ...], what: str, fix: str) -> dict[str, np.ndarray]:
    """The named arrays of an .npz file, read without unpickling anything (object arrays are refused)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {f: z[f] for f in fields if f in z.files}
    except (ValueError, TypeError, OSError, EOFError, zipfile.BadZipFile) as e:  # TypeError: a bare .npy
        raise DataError(f"{path}: not a {what} of plain arrays ({type(e).__name__}); {fix}") from None
    missing = [f for f in fields if f not in arrays]
    if missing:
        raise DataError(f"{path}: not a {what} (missing arrays {missing}); {fix}")
    return arrays


# ---------------------------------------------------------------- shards


@dataclass
class Shard:
    """Finished sequences: prompt and response ids (uint16, concatenated) and their bookkeeping."""

    prompt_id: np.ndarray  # (S,) int32: line in prompts.jsonl
    temperature: np.ndarray  # (S,) float32: 0 = greedy
    seed: np.ndarray  # (S,) int64: sampling seed (unused when greedy)
    prompt_len: np.ndarray  # (S,) int32
    resp_len: np.ndarray  # (S,) int32
    prompt_tokens: np.ndarray  # (sum prompt_len,) uint16
    resp_tokens: np.ndarray  # (sum resp_len,) uint16

    FIELDS = ("prompt_id", "temperature", "seed", "prompt_len", "resp_len", "prompt_tokens", "resp_tokens")

    @classmethod
    def from_sequences(cls, seqs: list[dict]) -> Shard:
        """Dicts with prompt_id, temperature, seed, prompt and response (lists of ids) -> a shard."""
        if any(max(s["prompt"] + s["response"], default=0) > np.iinfo(np.uint16).max for s in seqs):
            raise DataError("token ids above 65535 do not fit the uint16 shards; widen the dtype")
        cat = lambda key: np.array([t for s in seqs for t in s[key]], dtype=np.uint16)  # noqa: E731
        return cls(np.array([s["prompt_id"] for s in seqs], np.int32),
                   np.array([s["temperature"] for s in seqs], np.float32),
                   np.array([s["seed"] for s in seqs], np.int64),
                   np.array([len(s["prompt"]) for s in seqs], np.int32),
                   np.array([len(s["response"]) for s in seqs], np.int32),
                   cat("prompt"), cat("response"))

    def save(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez_compressed(tmp, **{f: getattr(self, f) for f in self.FIELDS})
        os.replace(tmp, path)  # a shard appears whole or not at all

    @classmethod
    def load(cls, path: Path) -> Shard:
        fix = "delete the shard and regenerate"
        shard = cls(**read_arrays(path, cls.FIELDS, "distillation shard", fix))
        n = len(shard.prompt_id)
        if any(len(getattr(shard, f)) != n for f in cls.FIELDS[:5]):
            raise DataError(f"{path}: its per-sequence arrays differ in length; {fix}")
        if shard.prompt_len.sum() != len(shard.prompt_tokens) or shard.resp_len.sum() != len(shard.resp_tokens):
            raise DataError(f"{path}: lengths do not add up to the stored tokens; {fix}")
        return shard

    def __len__(self) -> int:
        return len(self.prompt_id)

    def sequences(self):
        """Yield (prompt ids, response ids) as int64 arrays."""
        po = np.concatenate([[0], np.cumsum(self.prompt_len)])
        ro = np.concatenate([[0], np.cumsum(self.resp_len)])
        for i in range(len(self)):
            yield (self.prompt_tokens[po[i]:po[i + 1]].astype(np.int64),
                   self.resp_tokens[ro[i]:ro[i + 1]].astype(np.int64))


def shard_paths(data_dir: str | Path) -> list[Path]:
    return sorted(p for p in Path(data_dir).glob("gen-*.npz") if not p.name.endswith(".tmp.npz"))


def shard_number(path: Path) -> int:
    return int(path.stem.split("-")[1])


def item_key(prompt_id: int, temperature: float, seed: int) -> tuple[int, float, int]:
    """What identifies a generated sequence; greedy ones ignore the seed."""
    return (int(prompt_id), round(float(temperature), 3), 0 if temperature == 0 else int(seed))


def done_keys(data_dir: str | Path) -> set[tuple[int, float, int]]:
    """item_key of every sequence already in a shard."""
    keys = set()
    for p in shard_paths(data_dir):
        s = Shard.load(p)
        # float64 first: a float32 0.7 would round to 0.699999988 and never match the work item's 0.7
        temps = np.round(s.temperature.astype(np.float64), 3).tolist()
        keys.update(item_key(i, t, d) for i, t, d in zip(s.prompt_id.tolist(), temps, s.seed.tolist()))
    return keys


def check_data_target(data_dir: str | Path, config: ModelConfig, tokenizer, create: bool = False) -> None:
    """data_dir/target.json names the target whose text the shards hold (its config and tokenizer
    fingerprint); refuse to mix text or labels from another target into one directory.
    With create, write it when absent (generate does, before its first shard)."""
    path = Path(data_dir) / MANIFEST
    mine = {"config": config.to_dict(), "tokenizer_fingerprint": tokenizer.fingerprint if tokenizer else None}
    if not path.is_file():
        if create:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(mine, indent=2, sort_keys=True) + "\n")
        return
    theirs = json.loads(path.read_text())
    diff = [k for k in mine["config"] if theirs.get("config", {}).get(k) != mine["config"][k]]
    if theirs.get("tokenizer_fingerprint") != mine["tokenizer_fingerprint"]:
        diff.append("tokenizer")
    if diff:
        raise DataError(f"{data_dir} holds text generated by another target (it differs in {', '.join(diff)}; "
                        f"see {path}); give this target its own --data directory")


# ---------------------------------------------------------------- soft labels


def labels_path(labels_dir: str | Path, shard: Path) -> Path:
    return Path(labels_dir) / (shard.stem + ".labels.npz")


def save_labels(path: Path, ids: np.ndarray, logp: np.ndarray) -> None:
    """Top-k soft labels of a shard's response positions: ids (N, k) uint16, log-probs (N, k) float16."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, ids=ids.astype(np.uint16), logp=logp.astype(np.float16))
    os.replace(tmp, path)


def load_labels(path: Path, shard: Shard, shard_path: Path, topk: int) -> tuple[np.ndarray, np.ndarray]:
    """The soft labels of `shard`, checked against it: ids (N, topk) and log-probs (N, topk)."""
    fix = f"delete {path} to recompute it"
    z = read_arrays(path, ("ids", "logp"), "soft-label file", fix)
    ids, logp = z["ids"], z["logp"]
    if ids.ndim != 2 or ids.shape != logp.shape or len(ids) != len(shard.resp_tokens) or ids.shape[1] < topk:
        raise DataError(f"{path}: labels of shape {ids.shape} do not match {shard_path} "
                        f"({len(shard.resp_tokens)} response tokens, top-{topk}); {fix}")
    return ids[:, :topk], logp[:, :topk]


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (..., V) -> the k most likely ids and their log-probabilities under the full softmax."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    vals, ids = logp.topk(k, dim=-1)
    return ids, vals


def length_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped in ascending length, each group about `max_tokens` once padded to its longest."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups, start = [], 0
    while start < len(order):
        end = start + 1  # lengths ascend, so the last member sets the padded width
        while end < len(order) and lengths[order[end]] * (end - start + 1) <= max_tokens:
            end += 1
        groups.append(order[start:end])
        start = end
    return groups


@torch.inference_mode()
def compute_labels(target: Transformer, shard: Shard, topk: int = TOPK,
                   max_tokens: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """Top-k target log-probabilities at every response position of `shard`, by full forward passes.

    The logits at position t predict token t+1, so the response token r_j is
    predicted at position P-1+j (P = prompt length). Sequences are batched by
    length (about `max_tokens` padded tokens per pass) and the lm_head is applied
    to the response positions only: the prompt's logits are never needed.
    """
    seqs = list(shard.sequences())
    full = [np.concatenate([p, r]) for p, r in seqs]
    ids_out: list = [None] * len(seqs)
    logp_out: list = [None] * len(seqs)
    for chunk in length_batches([len(f) for f in full], max_tokens):
        T = len(full[chunk[-1]])
        x = torch.zeros(len(chunk), T, dtype=torch.long)  # right padding never affects earlier positions (causal)
        for b, i in enumerate(chunk):
            x[b, :len(full[i])] = torch.from_numpy(full[i])
        x = x.to(target.device)
        h = target._trunk(x, torch.arange(T, device=target.device).expand(len(chunk), T))
        for b, i in enumerate(chunk):
            p, r = seqs[i]
            ids, lp = topk_logprobs(target.logits(h[b, len(p) - 1:len(p) - 1 + len(r)]), topk)
            ids_out[i], logp_out[i] = ids.cpu().numpy(), lp.cpu().numpy()
    return np.concatenate(ids_out), np.concatenate(logp_out)


# ---------------------------------------------------------------- training examples


@dataclass
class Example:
    """One sequence for training: prompt + response ids and the soft labels of the response positions."""

    key: tuple[int, int]  # (shard number, index in shard): stable across runs
    prompt_id: int
    tokens: np.ndarray  # (P + R,) int64
    prompt_len: int
    label_ids: np.ndarray  # (R, k) uint16
    label_logp: np.ndarray  # (R, k) float16


def shard_examples(path: Path, shard: Shard, ids: np.ndarray, logp: np.ndarray) -> list[Example]:
    """A shard's sequences with their slices of the shard's soft labels."""
    out, off = [], 0
    for i, (p, r) in enumerate(shard.sequences()):
        out.append(Example((shard_number(path), i), int(shard.prompt_id[i]), np.concatenate([p, r]), len(p),
                           ids[off:off + len(r)], logp[off:off + len(r)]))
        off += len(r)
    return out


def load_examples(data_dir: str | Path, labels_dir: str | Path, target_path: str | None = TARGET,
                  topk: int = TOPK, device: str | None = None,
                  target_dtype: torch.dtype | None = None) -> list[Example]:
    """Every sequence of every shard with its soft labels; missing labels are recomputed with the target."""
    if target_path is not None:
        tokenizer = load_tokenizer(target_path)
        cfg = limit_to_tokenizer(ModelConfig.load(str(Path(target_path) / "config.json")), tokenizer)
        check_data_target(data_dir, cfg, tokenizer)
    target = None
    out = []
    for path in shard_paths(data_dir):
        shard = Shard.load(path)
        lp = labels_path(labels_dir, path)
        if not lp.is_file():
            if target is None:
                if target_path is None:
                    raise FileNotFoundError(f"{lp} is missing and no target was given to recompute it")
                log(f"recomputing soft labels with {target_path} (missing: {lp})")
                target = Transformer.from_pretrained(target_path, device=device, dtype=target_dtype)
            save_labels(lp, *compute_labels(target, shard, topk))
        out += shard_examples(path, shard, *load_labels(lp, shard, path, topk))
    return out


def is_validation(prompt_id: int) -> bool:
    """A fixed 2% of the train prompts whose sequences are kept out of training to watch overfitting."""
    return prompt_id % 50 == 7


def n_tokens(examples: list[Example]) -> int:
    """Response tokens (labelled positions) in the examples."""
    return sum(len(e.label_ids) for e in examples)
