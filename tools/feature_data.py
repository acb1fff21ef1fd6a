"""The feature draft's training data: the target's final hidden states over text, with its top-k predictions.

Two sources, each a list of work items (`work_items`):

- "gen": the target's own greedy answers to the code prompts of data/distill/prompts.jsonl (train split;
  the bench's coder prompts are never among them), batched over its paged KV cache; the prompt's states
  come from the prefill, the answer's from the decode steps, so collecting costs no pass beyond generating.
- "src": the source code of installed packages (the .py files of the environment's site-packages, read
  in a fixed order), cut into pieces and run through the target teacher-forced. No hub serves it.

Shards (RUN/data/shard-NNNNN.npz, written whole, read without unpickling) hold per sequence its item
name and length, and per position the token id, the target's state there (fp16) and its top-k ids and
log-probabilities (the state at position i predicts token i+1). A restart skips every item already in
a shard; tqdm shows the items done.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from minispec import Transformer

TOPK = 8  # the target's predictions kept per position: the soft label of sampled drafting
FIELDS = ("names", "lengths", "tokens", "states", "top_ids", "top_logp")


def shard_paths(data_dir: Path) -> list[Path]:
    return sorted(p for p in Path(data_dir).glob("shard-*.npz") if not p.name.endswith(".tmp.npz"))


def load_shard(path: Path) -> dict[str, np.ndarray]:
    """A shard's arrays, checked to add up (object arrays are refused: nothing is unpickled)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {f: z[f] for f in FIELDS}
    except (ValueError, KeyError, OSError, EOFError) as e:
        raise ValueError(f"{path}: not a feature-data shard ({type(e).__name__}); delete it, collect again") from None
    n = int(arrays["lengths"].sum())
    if not all(len(arrays[f]) == n for f in FIELDS[2:]) or len(arrays["names"]) != len(arrays["lengths"]):
        raise ValueError(f"{path}: its arrays do not add up; delete it and collect again")
    return arrays


def done_names(data_dir: Path) -> set[str]:
    return {str(n) for p in shard_paths(data_dir) for n in load_shard(p)["names"]}


def save_shard(data_dir: Path, seqs: list[dict]) -> None:
    """Sequences (name, tokens, states (T, D), top_ids, top_logp) -> the next shard, written whole."""
    data_dir.mkdir(parents=True, exist_ok=True)
    done = shard_paths(data_dir)
    n = int(done[-1].stem.split("-")[1]) + 1 if done else 0
    path = data_dir / f"shard-{n:05d}.npz"
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, names=np.array([s["name"] for s in seqs]), lengths=np.array([len(s["tokens"]) for s in seqs]),
             tokens=np.concatenate([s["tokens"] for s in seqs]).astype(np.int32),
             states=np.concatenate([s["states"] for s in seqs]).astype(np.float16),
             top_ids=np.concatenate([s["top_ids"] for s in seqs]).astype(np.int32),
             top_logp=np.concatenate([s["top_logp"] for s in seqs]).astype(np.float16))
    os.replace(tmp, path)


def read_sequences(data_dir: Path) -> list[dict[str, np.ndarray]]:
    """Every sequence of every shard: dicts of tokens (T,), states (T, D), top_ids (T, K), top_logp (T, K)."""
    out = []
    for p in shard_paths(data_dir):
        a = load_shard(p)
        ends = np.cumsum(a["lengths"])
        for name, end, n in zip(a["names"], ends, a["lengths"]):
            sl = slice(end - n, end)
            out.append({"name": str(name), **{f: a[f][sl] for f in FIELDS[2:]}})
    return out


def gen_items(prompts_file: str, target: Transformer, n: int, kinds=("code",)) -> list[tuple[str, list[int]]]:
    """("gen-ID", the chat-rendered prompt) for the first n train prompts of these kinds."""
    items = []
    for line in Path(prompts_file).read_text().splitlines():
        p = json.loads(line)
        if p["split"] == "train" and p["kind"] in kinds and len(items) < n:
            items.append((f"gen-{p['id']}", target.tokenizer.encode_chat(p["messages"])))
    return items


def src_items(target: Transformer, n: int, piece: int = 256) -> list[tuple[str, list[int]]]:
    """("src-PATH-I", ids) pieces of the site-packages' .py files, files in sorted order, up to n pieces."""
    root = Path(sysconfig.get_paths()["purelib"])
    items = []
    for path in sorted(root.rglob("*.py")):
        if len(items) >= n:
            break
        text = path.read_text(errors="replace")
        if len(text) < 2000:  # stubs and __init__ files: little code in them
            continue
        ids = target.tokenizer.encode(text[:8000])
        for i in range(0, min(len(ids), 2 * piece) - piece // 2, piece):
            items.append((f"src-{path.relative_to(root)}-{i}", ids[i:i + piece]))
    return items[:n]


def top_k(target: Transformer, h: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    logp = torch.log_softmax(target.logits(h).float(), dim=-1)
    vals, ids = logp.topk(TOPK, dim=-1)
    return ids.numpy(), vals.numpy()


@torch.inference_mode()
def generate_batch(target: Transformer, batch: list[tuple[str, list[int]]], max_new: int) -> list[dict]:
    """Greedy answers for a batch of prompts, with the states and top-k at every position."""
    cache = target.new_cache()
    seqs = [cache.new_sequence() for _ in batch]
    h = target.step(cache, seqs, [p for _, p in batch], hidden=True)  # (B, T, D)
    out = []
    for b, (name, p) in enumerate(batch):
        out.append({"name": name, "tokens": list(p), "states": [h[b, :len(p)]]})
    last = [h[b, len(p) - 1] for b, (_, p) in enumerate(batch)]
    live = list(range(len(batch)))
    stops = set(target.config.stop_ids)
    for _ in range(max_new):
        nxt = target.logits(torch.stack([last[b] for b in live])).argmax(-1).tolist()
        still = []
        for b, t in zip(live, nxt):
            out[b]["tokens"].append(t)
            if t not in stops:
                still.append(b)
        live = still
        if not live:
            break
        h = target.step(cache, [seqs[b] for b in live], [[out[b]["tokens"][-1]] for b in live], hidden=True)
        for j, b in enumerate(live):
            out[b]["states"].append(h[j, -1:])
            last[b] = h[j, -1]
    for s in out:  # the last token (a stop, or the budget's end) was never fed: drop it
        s["tokens"] = np.array(s["tokens"][:len(torch.cat(s["states"]))])
        s["states"] = torch.cat(s["states"])
        s["top_ids"], s["top_logp"] = top_k(target, s["states"])
        s["states"] = s["states"].numpy()
    return out


@torch.inference_mode()
def forward_batch(target: Transformer, batch: list[tuple[str, list[int]]]) -> list[dict]:
    """Teacher-forced states and top-k of a batch of token pieces (one full causal pass)."""
    T = max(len(p) for _, p in batch)
    x = torch.zeros(len(batch), T, dtype=torch.long)
    for b, (_, p) in enumerate(batch):
        x[b, :len(p)] = torch.tensor(p)
    h = target._trunk(x, torch.arange(T).expand(len(batch), T))
    out = []
    for b, (name, p) in enumerate(batch):
        ids, logp = top_k(target, h[b, :len(p)])
        out.append({"name": name, "tokens": np.array(p), "states": h[b, :len(p)].numpy(), "top_ids": ids,
                    "top_logp": logp})
    return out


def collect(target_dir: str, data_dir: Path, prompts_file: str, n_gen: int, n_src: int, max_new: int,
            batch: int = 8, minutes: float | None = None) -> None:
    """Collect the missing items (gen first), a shard per batch; stops after `minutes` at a batch's end."""
    import time
    t0 = time.time()
    target = Transformer.from_pretrained(target_dir, dtype=torch.float32)
    done = done_names(data_dir)
    work = [("gen", it) for it in gen_items(prompts_file, target, n_gen)] + [("src", it) for it in
                                                                              src_items(target, n_src)]
    todo = [(kind, it) for kind, it in work if it[0] not in done]
    bar = tqdm(total=len(work), initial=len(work) - len(todo), desc="collect", unit="item", file=sys.stderr)
    for i in range(0, len(todo), batch):
        if minutes is not None and time.time() - t0 > 60 * minutes:
            break
        chunk = todo[i:i + batch]
        gens = [it for kind, it in chunk if kind == "gen"]
        srcs = [it for kind, it in chunk if kind == "src"]
        seqs = (generate_batch(target, gens, max_new) if gens else []) + (forward_batch(target, srcs) if srcs else [])
        save_shard(data_dir, seqs)
        bar.update(len(chunk))
    bar.close()
