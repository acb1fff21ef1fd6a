"""Distil a small draft model for speculative decoding from a target's own generations.

    python tools/distill_draft.py --target DIR --out DIR [--data DIR] [--gen-minutes M] [--train-minutes M] [--measure]
                                           # all of it: generate, train, export the best draft to --out
    python tools/distill_draft.py generate [--minutes M] [--batch 64] [--max-new-tokens 256] [--device cuda]
    python tools/distill_draft.py train    [--minutes M] [--run runs/distill/main] [--min-growth 0.1] [--device cuda]
    python tools/distill_draft.py export   [--run runs/distill/main] [--out weights/smollm2-135m-draft]
    python tools/distill_draft.py measure  [--draft weights/smollm2-135m-draft] [--n-prompts 32] [--no-speculate]

Every stage is resumable: kill it at any moment and run the same command again.
On a shared CPU run generate and train side by side under `nice -n 19`, train
with `--threads 1 --min-growth 0.1` so the generator keeps most of the CPU.

1. generate: the target answers the prompts of data/distill/prompts.jsonl
   (tools/distill_prompts.py; chat template applied), greedily and, for every
   `--sample-every`-th prompt, also sampled at T=0.7, since the draft must
   predict both. Sequences run through the target's paged KV cache with
   continuous batching: a finished sequence frees its blocks and a new prompt
   takes its place, so the batch stays full. Finished sequences are appended
   to compact shards data/distill/gen-*.npz (uint16 token ids; committed);
   a restart skips every (prompt, temperature) already in a shard.
   The target's top-k log-probabilities at every generated position come for
   free from the decode logits and are cached beside the shard under
   runs/distill/labels/ (git-ignored, large). When they are missing (a fresh
   checkout), `train` recomputes them with one target forward pass per
   sequence, which costs far less than generating.
2. train: a small `Transformer` (same class, same vocab, a subset lm_head
   over the most frequent target tokens) learns from the target's soft labels
   (cross-entropy against the renormalised top-k distribution) plus the hard
   next token. Checkpoints (model + optimizer + data position + RNG) go to
   the run directory every few minutes; a restart resumes where it stopped.
3. export: the run's latest weights -> a bf16 checkpoint with the target's
   tokenizer files, loadable with `Transformer.from_pretrained`.
4. measure: on held-out prompts (never generated from), the greedy acceptance
   rate and tokens per round at k=4 (with `target.speculate` when the library
   has it; otherwise teacher-forced top-1 agreement on the target's greedy
   continuation, labelled as a proxy), and the cost of one draft decode step
   relative to one target step (median of many, same thread count).

References: Hinton et al. 2015 (distillation); Leviathan et al. 2023 and
Chen et al. 2023 (speculative decoding); Zhou et al. 2023, DistillSpec
(distilling on the target's own generations, on-policy data helps acceptance).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

try:  # run from a source checkout without installing minispec
    import minispec  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from distill_prompts import load_prompts  # noqa: E402
from minispec import ModelConfig, Transformer  # noqa: E402
from minispec.tokenizer import load_tokenizer  # noqa: E402
from minispec.sampling import SamplingParams, logits_to_probs, make_generators, sample  # noqa: E402
from minispec.speculative import check_compatible  # noqa: E402

TARGET = "weights/smollm2-135m-instruct"
DATA = "data/distill"
PROMPTS = "data/distill/prompts.jsonl"
LABELS = "runs/distill/labels"
RUN = "runs/distill/main"
DRAFT_OUT = "weights/smollm2-135m-draft"
TOPK = 32  # soft labels kept per position
# --target-dtype: bfloat16 runs the target 1.6-2.2x faster on CPUs with AMX (measured here: generation
# 325 vs 203 tokens/s at batch 64, soft labels 870 vs 394) at a cost of ~2% argmax flips against float32
# (KL 0.001 nat)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def set_threads(n: int) -> None:
    torch.set_num_threads(n)
    os.environ.setdefault("OMP_NUM_THREADS", str(n))


def render_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Chat messages -> prompt ids ending with the assistant header, exactly as a chat user would send them."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(text, bos=False)


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
    def from_sequences(cls, seqs: list[dict]) -> "Shard":
        if any(max(s["prompt"] + s["response"], default=0) > np.iinfo(np.uint16).max for s in seqs):
            raise ValueError("token ids above 65535 do not fit the uint16 shards; widen the dtype")
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
    def load(cls, path: Path) -> "Shard":
        with np.load(path) as z:
            missing = [f for f in cls.FIELDS if f not in z]
            if missing:
                raise ValueError(f"{path}: not a distillation shard (missing arrays {missing})")
            shard = cls(**{f: z[f] for f in cls.FIELDS})
        if shard.prompt_len.sum() != len(shard.prompt_tokens) or shard.resp_len.sum() != len(shard.resp_tokens):
            raise ValueError(f"{path}: lengths do not add up to the stored tokens; delete the shard and regenerate")
        return shard

    def __len__(self) -> int:
        return len(self.prompt_id)

    def sequences(self):
        """Yield (prompt ids, response ids) as int64 arrays."""
        po = np.concatenate([[0], np.cumsum(self.prompt_len)])
        ro = np.concatenate([[0], np.cumsum(self.resp_len)])
        for i in range(len(self)):
            yield (self.prompt_tokens[po[i]:po[i + 1]].astype(np.int64), self.resp_tokens[ro[i]:ro[i + 1]].astype(np.int64))


def shard_paths(data_dir: str | Path) -> list[Path]:
    return sorted(p for p in Path(data_dir).glob("gen-*.npz") if not p.name.endswith(".tmp.npz"))


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


MANIFEST = "target.json"


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
        raise ValueError(f"{data_dir} holds text generated by another target (it differs in {', '.join(diff)}; "
                         f"see {path}); give this target its own --data directory")


def labels_path(labels_dir: str | Path, shard: Path) -> Path:
    return Path(labels_dir) / (shard.stem + ".labels.npz")


def save_labels(path: Path, ids: np.ndarray, logp: np.ndarray) -> None:
    """Top-k soft labels of a shard's response positions: ids (N, k) uint16, log-probs (N, k) float16."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, ids=ids.astype(np.uint16), logp=logp.astype(np.float16))
    os.replace(tmp, path)


# ---------------------------------------------------------------- 1. generate


def work_items(prompts: list[dict], sample_every: int, temperature: float,
               samples: int = 1) -> list[tuple[int, float, int]]:
    """(prompt id, temperature, seed) to generate, in file order.

    Greedy for every train prompt, and `samples` sampled answers for every
    `sample_every`-th one. Sample j of prompt i has seed i + 1,000,000 j, so
    asking for more samples later keeps every sequence already generated.
    """
    items = []
    for p in prompts:
        if p["split"] != "train":
            continue
        items.append((p["id"], 0.0, 0))
        if sample_every and p["id"] % sample_every == 0:
            items += [(p["id"], temperature, p["id"] + 1_000_000 * j) for j in range(samples)]
    return items


def shared_prefix(seqs: list[list[int]]) -> list[int]:
    """The longest common prefix of some token lists."""
    if not seqs:
        return []
    n = min(len(s) for s in seqs)
    first = seqs[0]
    for i in range(n):
        if any(s[i] != first[i] for s in seqs):
            return first[:i]
    return first[:n]


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (..., V) -> the k most likely ids and their log-probabilities under the full softmax."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    vals, ids = logp.topk(k, dim=-1)
    return ids, vals


def generate_stage(target: Transformer, prompts: list[dict], data_dir: str | Path, labels_dir: str | Path,
                   batch: int = 64, max_new_tokens: int = 256, sample_every: int = 3, temperature: float = 0.7,
                   samples: int = 1, flush_every: int = 128, flush_seconds: float = 300.0, minutes: float | None = None,
                   max_items: int | None = None, topk: int = TOPK, refill: int = 8, progress: bool = True) -> int:
    """Generate target responses for every train prompt not yet in a shard; returns the number of new sequences.

    Continuous batching over one paged cache: up to `batch` sequences decode
    together; whenever `refill` slots are free (or the batch is empty) new
    prompts are prefilled together and join. Stops after `minutes` (finishing
    nothing in flight: unfinished sequences are simply redone next time).
    """
    data_dir, labels_dir = Path(data_dir), Path(labels_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    tok = target.tokenizer
    if tok is None:
        raise ValueError("the target checkpoint has no tokenizer files; generate needs them to apply the chat template")
    check_data_target(data_dir, target.config, tok, create=True)
    done = done_keys(data_dir)
    todo = [it for it in work_items(prompts, sample_every, temperature, samples) if item_key(*it) not in done]
    if max_items is not None:
        todo = todo[:max_items]
    log(f"generate: {len(done)} sequences already in {data_dir}, {len(todo)} to go")
    if not todo:
        return 0
    stops = set(target.config.stop_ids)
    rendered = {}
    for pid, _, _ in todo[: batch * 4]:
        rendered[pid] = render_prompt(tok, prompts[pid]["messages"])
    block_size = 16
    max_prompt = max(len(v) for v in rendered.values())
    # room for `batch` sequences of the longest prompt seen so far plus the longest response, with slack
    per_seq = -(-(max(max_prompt, 256) + max_new_tokens) // block_size)
    cache = target.new_cache(num_blocks=batch * per_seq + 8, block_size=block_size)
    # Every chat prompt starts with the same system header: prefill it once and fork it
    # (the paged cache shares its blocks), so each new prompt prefills only its own part.
    prefix = shared_prefix(list(rendered.values()))
    root = None
    if len(prefix) >= block_size:
        prefix = prefix[: len(prefix) // block_size * block_size]  # whole blocks: no copy-on-write on fork
        root = cache.new_sequence()
        target.step(cache, [root], [prefix])

    deadline = time.time() + 60 * minutes if minutes else None
    next_shard = len(shard_paths(data_dir))
    finished: list[dict] = []
    lab_ids: list[np.ndarray] = []
    lab_logp: list[np.ndarray] = []
    last_flush = time.time()
    n_new_seqs = 0

    def flush():
        nonlocal next_shard, finished, lab_ids, lab_logp, last_flush
        if finished:
            while True:  # a name no other writer took (shards are never overwritten)
                path = data_dir / f"gen-{next_shard:05d}.npz"
                next_shard += 1
                if not path.exists():
                    break
            save_labels(labels_path(labels_dir, path), np.concatenate(lab_ids), np.concatenate(lab_logp))
            Shard.from_sequences(finished).save(path)
            log(f"wrote {path} ({len(finished)} sequences, {sum(len(s['response']) for s in finished)} tokens)")
        finished, lab_ids, lab_logp, last_flush = [], [], [], time.time()

    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(todo), unit="seq", desc="generate", file=sys.stderr, mininterval=20, smoothing=0.05)
    n_tokens, t_start = 0, time.time()
    queue = list(reversed(todo))  # pop() takes them in file order
    active: list[dict] = []
    logits = None
    try:
        while queue or active:
            out_of_time = deadline is not None and time.time() > deadline
            # -- admit new sequences (prefill them together) when enough slots are free
            if queue and not out_of_time and (len(active) == 0 or batch - len(active) >= refill):
                new = []
                while queue and len(active) + len(new) < batch:
                    pid, temp, seed = queue.pop()
                    ids = rendered.get(pid) or render_prompt(tok, prompts[pid]["messages"])
                    if len(ids) + max_new_tokens > per_seq * block_size:
                        log(f"skipping prompt {pid}: {len(ids)} tokens do not fit the cache layout")
                        continue
                    gen = make_generators(seed, 1)[0]
                    forked = root is not None and ids[: len(prefix)] == prefix and len(ids) > len(prefix)
                    new.append({"prompt_id": pid, "temperature": temp, "seed": seed, "prompt": ids, "response": [],
                                "params": SamplingParams(temp), "gen": gen,
                                "seq": cache.fork(root) if forked else cache.new_sequence(),
                                "skip": len(prefix) if forked else 0, "ids": [], "logp": []})
                if new:
                    new_logits = target.step(cache, [s["seq"] for s in new], [s["prompt"][s["skip"]:] for s in new])
                    # decode rows first, then the new ones (logits of the active rows come from the previous step)
                    logits = new_logits if not active else torch.cat([logits, new_logits])
                    active = active + new
            if out_of_time and not active:
                break
            if not active:
                continue
            # -- one token for every active sequence from its logits
            ids_k, logp_k = (t.cpu() for t in topk_logprobs(logits, topk))
            still, next_tokens = [], []
            for row, s in enumerate(active):
                if s["params"].greedy:
                    t = int(logits[row].argmax())
                else:
                    t = sample(logits_to_probs(logits[row], s["params"]), s["gen"])
                s["response"].append(t)
                s["ids"].append(ids_k[row].numpy())
                s["logp"].append(logp_k[row].numpy())
                n_tokens += 1
                if t in stops or len(s["response"]) >= max_new_tokens:
                    cache.free(s["seq"])
                    finished.append({k: s[k] for k in ("prompt_id", "temperature", "seed", "prompt", "response")})
                    lab_ids.append(np.stack(s["ids"]))
                    lab_logp.append(np.stack(s["logp"]))
                    n_new_seqs += 1
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(tok=n_tokens, tok_s=f"{n_tokens / (time.time() - t_start):.1f}", refresh=False)
                elif out_of_time:
                    cache.free(s["seq"])  # dropped: redone by the next run
                else:
                    still.append(s)
                    next_tokens.append([t])
            active = still
            if len(finished) >= flush_every or (finished and time.time() - last_flush > flush_seconds):
                flush()
            if active:
                logits = target.step(cache, [s["seq"] for s in active], next_tokens)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: keep every finished sequence; only those in flight are redone
        log("interrupted: writing the finished sequences")
        flush()
        raise
    flush()
    if bar is not None:
        bar.close()
    dt = time.time() - t_start
    log(f"generate: {n_new_seqs} sequences, {n_tokens} tokens in {dt:.0f}s ({n_tokens / max(dt, 1e-9):.1f} tokens/s)")
    return n_new_seqs


# ---------------------------------------------------------------- soft labels


@torch.inference_mode()
def compute_labels(target: Transformer, shard: Shard, topk: int = TOPK, max_tokens: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """Top-k target log-probabilities at every response position of `shard`, by full forward passes.

    The logits at position t predict token t+1, so the response token r_j is
    predicted at position P-1+j (P = prompt length). Sequences are batched by
    length (about `max_tokens` padded tokens per pass) and the lm_head is applied
    to the response positions only: the prompt's logits are never needed.
    """
    seqs = list(shard.sequences())
    full = [np.concatenate([p, r]) for p, r in seqs]
    order = sorted(range(len(seqs)), key=lambda i: len(full[i]))
    ids_out: list = [None] * len(seqs)
    logp_out: list = [None] * len(seqs)
    start = 0
    while start < len(order):
        end = start + 1  # lengths ascend, so the last member sets the padded width
        while end < len(order) and len(full[order[end]]) * (end - start + 1) <= max_tokens:
            end += 1
        chunk = order[start:end]
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
        start = end
    return np.concatenate(ids_out), np.concatenate(logp_out)


# ---------------------------------------------------------------- 2. train


@dataclass
class Example:
    """One sequence for training: prompt + response ids and the soft labels of the response positions."""

    key: tuple[int, int]  # (shard number, index in shard): stable across runs
    prompt_id: int
    tokens: np.ndarray  # (P + R,) int64
    prompt_len: int
    label_ids: np.ndarray  # (R, k) uint16
    label_logp: np.ndarray  # (R, k) float16


def shard_number(path: Path) -> int:
    return int(path.stem.split("-")[1])


def load_examples(data_dir: str | Path, labels_dir: str | Path, target_path: str | None = TARGET,
                  topk: int = TOPK, device: str | None = None, target_dtype: torch.dtype | None = None) -> list[Example]:
    """Every sequence of every shard with its soft labels; missing labels are recomputed with the target."""
    if target_path is not None:
        check_data_target(data_dir, ModelConfig.load(str(Path(target_path) / "config.json")), load_tokenizer(target_path))
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
        with np.load(lp) as z:
            ids, logp = z["ids"], z["logp"]
        if len(ids) != len(shard.resp_tokens) or ids.shape[1] < topk:
            raise ValueError(f"{lp}: labels of shape {ids.shape} do not match {path} "
                             f"({len(shard.resp_tokens)} response tokens, top-{topk}); delete {lp} to recompute it")
        off = 0
        for i, (p, r) in enumerate(shard.sequences()):
            out.append(Example((shard_number(path), i), int(shard.prompt_id[i]), np.concatenate([p, r]), len(p),
                               ids[off:off + len(r), :topk], logp[off:off + len(r), :topk]))
            off += len(r)
    return out


def is_validation(prompt_id: int) -> bool:
    """A fixed 2% of the train prompts whose sequences are kept out of training to watch overfitting."""
    return prompt_id % 50 == 7


def frequent_tokens(examples: list[Example], n: int, vocab_size: int, always: tuple[int, ...]) -> torch.Tensor:
    """The n most frequent target tokens in the examples' responses and soft labels (plus `always`), sorted."""
    if n > vocab_size:
        raise ValueError(f"head_vocab={n} exceeds the vocabulary ({vocab_size} ids)")
    counts = np.zeros(vocab_size, dtype=np.int64)
    for e in examples:
        np.add.at(counts, e.tokens[e.prompt_len:], 1)
        np.add.at(counts, e.label_ids[:, :4].astype(np.int64).ravel(), 1)  # tokens the target nearly chose
    for t in always:
        counts[t] = counts.max() + 1
    top = np.argsort(-counts, kind="stable")[:n]
    return torch.from_numpy(np.sort(top)).long()


def make_draft_config(target_cfg: ModelConfig, dim: int, n_layers: int, n_heads: int, n_kv_heads: int,
                      ffn_dim: int | None, head_vocab: int) -> ModelConfig:
    """A small config of the target's family: same vocab, RoPE, special ids and context length."""
    return ModelConfig(vocab_size=target_cfg.vocab_size, dim=dim, n_layers=n_layers, n_heads=n_heads,
                       n_kv_heads=n_kv_heads, ffn_dim=ffn_dim, norm_eps=target_cfg.norm_eps,
                       rope_theta=target_cfg.rope_theta, rope_scaling=target_cfg.rope_scaling,
                       max_seq_len=target_cfg.max_seq_len, tie_embeddings=False, head_vocab_size=head_vocab,
                       bos_id=target_cfg.bos_id, eos_id=target_cfg.eos_id)


@torch.no_grad()
def init_draft_from_target(draft: Transformer, target_embed: torch.Tensor, weights: torch.Tensor | None = None) -> None:
    """Embeddings = the target's, projected on its top `dim` principal directions; lm_head rows = the same rows.

    The target ties its lm_head to its embedding, so projected rows start the
    draft with the target's notion of which tokens are alike, in both places.
    `weights` (vocab,) weighs rows by token frequency when finding the directions.
    """
    E = target_embed.float()  # (V, D_target)
    if draft.config.dim > E.shape[1]:
        raise ValueError(f"draft dim {draft.config.dim} exceeds the target's {E.shape[1]}: cannot project the embedding")
    w = torch.ones(E.shape[0]) if weights is None else weights.float()
    mean = (E * w[:, None]).sum(0) / w.sum()
    X = (E - mean) * w.sqrt()[:, None]
    _, _, Vh = torch.linalg.svd(X, full_matrices=False)  # Vh: (D_target, D_target), rows = directions
    P = Vh[: draft.config.dim].T  # (D_target, dim)
    proj = (E - mean) @ P  # (V, dim)
    proj = proj / proj.std() * 0.02 * math.sqrt(draft.config.dim / 16)  # a modest scale; RMSNorm follows anyway
    draft.embed_tokens.weight.copy_(proj)
    # scaled down: at init the residual stream is mostly the input embedding, and full-size output rows
    # would confidently predict "the same token again"
    draft.lm_head.weight.copy_(0.1 * proj[draft.head_ids])


def draft_head_logits(draft: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """Differentiable forward (B, T) -> logits over the head's ids only (B, T, H).

    Transformer.forward runs under inference_mode (no autograd) and widens to
    the full vocabulary; training needs neither.
    """
    B, T = tokens.shape
    positions = torch.arange(T, device=tokens.device).expand(B, T)
    h = draft._trunk(tokens, positions)  # (B, T, dim)
    return F.linear(h, draft.lm_head.weight)  # (B, T, H)


def make_batch(examples: list[Example], head_index: torch.Tensor) -> dict:
    """Right-padded inputs and per-position targets, in head-index space (-1 = not in the head)."""
    T = max(len(e.tokens) for e in examples) - 1
    B, k = len(examples), examples[0].label_ids.shape[1]
    x = torch.zeros(B, T, dtype=torch.long)
    hard = torch.full((B, T), -1, dtype=torch.long)
    soft_ids = torch.full((B, T, k), -1, dtype=torch.long)
    soft_p = torch.zeros(B, T, k)
    top1 = torch.full((B, T), -2, dtype=torch.long)  # the target's argmax (-2: not a scored position)
    for b, e in enumerate(examples):
        t = torch.from_numpy(e.tokens)
        x[b, :len(t) - 1] = t[:-1]
        lo, hi = e.prompt_len - 1, len(t) - 1  # positions whose next token is a response token
        hard[b, lo:hi] = head_index[t[lo + 1:hi + 1]]
        ids = torch.from_numpy(e.label_ids.astype(np.int64))
        soft_ids[b, lo:hi] = head_index[ids]
        soft_p[b, lo:hi] = torch.from_numpy(e.label_logp.astype(np.float32)).exp()
        top1[b, lo:hi] = head_index[ids[:, 0]]
    soft_p = soft_p * (soft_ids >= 0)  # mass on tokens outside the head cannot be learned: drop it
    soft_p = soft_p / soft_p.sum(-1, keepdim=True).clamp_min(1e-9)
    return {"x": x, "hard": hard, "soft_ids": soft_ids.clamp_min(0), "soft_p": soft_p, "top1": top1,
            "scored": top1 > -2}


def distill_loss(logits: torch.Tensor, batch: dict, hard_weight: float) -> tuple[torch.Tensor, dict]:
    """Cross-entropy against the renormalised top-k target distribution + hard_weight x next-token CE.

    logits: (B, T, H) over the head. Returns the loss and metrics: `agree`, the
    fraction of scored positions where the draft's argmax is the target's argmax
    (the greedy acceptance of a single proposal).
    """
    logq = torch.log_softmax(logits.float(), dim=-1)  # (B, T, H)
    scored = batch["scored"]
    n = scored.sum().clamp_min(1)
    soft = -(batch["soft_p"] * logq.gather(-1, batch["soft_ids"])).sum(-1)  # (B, T)
    soft = (soft * scored).sum() / n
    hard_ok = batch["hard"] >= 0
    hard = -logq.gather(-1, batch["hard"].clamp_min(0).unsqueeze(-1)).squeeze(-1)
    hard = (hard * hard_ok).sum() / hard_ok.sum().clamp_min(1)
    agree = ((logq.argmax(-1) == batch["top1"]) & scored).sum() / n
    return soft + hard_weight * hard, {"soft": soft.item(), "hard": hard.item(), "agree": agree.item(), "n": int(n)}


def epoch_order(examples: list[Example], epoch: int, max_tokens: int, seed: int) -> list[list[tuple[int, int]]]:
    """Batches of example keys for one epoch: shuffled, grouped by length to waste little padding."""
    rng = np.random.default_rng(seed + epoch)
    idx = rng.permutation(len(examples))
    batches, chunk = [], 64
    for c in range(0, len(idx), chunk):
        group = sorted(idx[c:c + chunk], key=lambda i: len(examples[i].tokens))
        cur, cur_max = [], 0
        for i in group:
            L = len(examples[i].tokens)
            if cur and max(cur_max, L) * (len(cur) + 1) > max_tokens:
                batches.append(cur)
                cur, cur_max = [], 0
            cur.append(examples[i].key)
            cur_max = max(cur_max, L)
        if cur:
            batches.append(cur)
    order = rng.permutation(len(batches))
    return [batches[i] for i in order]


@dataclass
class TrainConfig:
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int | None = None
    head_vocab: int = 8192
    lr: float = 2e-3
    embed_lr: float = 5e-4  # the projected target embedding is already good: move it gently
    warmup: int = 100
    weight_decay: float = 0.01
    hard_weight: float = 0.5
    max_tokens: int = 4096  # tokens per batch (padded)
    seed: int = 0
    topk: int = TOPK


OPTIM_FIELDS = ("lr", "embed_lr", "warmup", "weight_decay", "hard_weight", "max_tokens")


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


def evaluate(draft: Transformer, examples: list[Example], head_index: torch.Tensor, cfg: TrainConfig) -> dict:
    """Loss and top-1 agreement over `examples` (teacher forcing), no gradients."""
    draft.eval()
    tot = {"soft": 0.0, "agree": 0.0, "n": 0}
    with torch.no_grad():
        for i in range(0, len(examples), 16):
            b = to_device(make_batch(examples[i:i + 16], head_index), draft.device)
            _, m = distill_loss(draft_head_logits(draft, b["x"]), b, cfg.hard_weight)
            for k in ("soft", "agree"):
                tot[k] += m[k] * m["n"]
            tot["n"] += m["n"]
    n = max(tot["n"], 1)
    return {"soft": tot["soft"] / n, "agree": tot["agree"] / n, "n": tot["n"]}


def save_checkpoint(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # an interrupted save leaves the previous checkpoint intact


def export_draft(draft: Transformer, tokenizer, out: str | Path, meta: dict | None = None) -> None:
    """Write the draft as a bf16 checkpoint with the target's tokenizer files (so the fingerprints match)."""
    draft.tokenizer = tokenizer
    draft.save_pretrained(out, dtype=torch.bfloat16)
    if meta:
        (Path(out) / "distill.json").write_text(json.dumps(meta, indent=2) + "\n")


def build_draft(cfg: TrainConfig, target_path: str, train_examples: list[Example]) -> Transformer:
    target = Transformer.from_pretrained(target_path)
    head_ids = frequent_tokens(train_examples, cfg.head_vocab, target.config.vocab_size, target.config.stop_ids)
    dcfg = make_draft_config(target.config, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim,
                             cfg.head_vocab)
    torch.manual_seed(cfg.seed)
    draft = Transformer(dcfg)
    draft.head_ids.copy_(head_ids)
    counts = torch.zeros(target.config.vocab_size)
    for e in train_examples:
        counts.index_add_(0, torch.from_numpy(e.tokens), torch.ones(len(e.tokens)))
    init_draft_from_target(draft, target.embed_tokens.weight.detach(), weights=counts + 1.0)
    draft.tokenizer = target.tokenizer
    return draft


def make_optimizer(draft: Transformer, cfg: TrainConfig) -> torch.optim.Optimizer:
    embed = [draft.embed_tokens.weight]
    decay = [p for n, p in draft.named_parameters() if p.dim() >= 2 and n != "embed_tokens.weight"]
    no_decay = [p for p in draft.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": embed, "lr": cfg.embed_lr, "weight_decay": 0.0, "base_lr": cfg.embed_lr},
                              {"params": decay, "lr": cfg.lr, "weight_decay": cfg.weight_decay, "base_lr": cfg.lr},
                              {"params": no_decay, "lr": cfg.lr, "weight_decay": 0.0, "base_lr": cfg.lr}],
                             betas=(0.9, 0.98), eps=1e-8)


def n_tokens(examples: list[Example]) -> int:
    return sum(len(e.label_ids) for e in examples)


def wait_for_growth(examples: list[Example], growth: float, data_dir, labels_dir, target_path,
                    deadline: float | None, poll: float = 60.0,
                    target_dtype: torch.dtype | None = None) -> tuple[list[Example], float]:
    """Re-read the shards until they hold `growth` x more response tokens (or the deadline passes)."""
    want = n_tokens(examples) * (1 + growth)
    t0 = time.time()
    while True:
        examples = load_examples(data_dir, labels_dir, target_path, target_dtype=target_dtype)
        if n_tokens(examples) >= want or (deadline is not None and time.time() > deadline):
            return examples, time.time() - t0
        time.sleep(poll)


def train_stage(run_dir: str | Path, data_dir: str | Path = DATA, labels_dir: str | Path = LABELS,
                target_path: str = TARGET, cfg: TrainConfig | None = None, minutes: float | None = None,
                max_steps: int | None = None, ckpt_minutes: float = 5.0, export_to: str | Path | None = None,
                export_minutes: float = 0.0, eval_every: int = 200, min_growth: float = 0.0,
                overrides: dict | None = None, device: str | None = None, progress: bool = True,
                target_dtype: torch.dtype | None = None, init_from: str | Path | None = None,
                autocast: bool = False) -> dict:
    """Train (or resume training) the draft in `run_dir`; returns the last validation metrics.

    The run directory holds ckpt.pt (model, optimizer, step, epoch, the epoch's
    batch order and the position in it, RNG) and train.jsonl (metrics). Each
    epoch re-reads the shards, so data generated meanwhile joins at the next epoch.
    With min_growth > 0 (training beside a running generator) a new epoch starts
    only once the data has grown by that fraction, so that the CPU goes to new
    target text rather than to yet another pass over the same few sequences.
    `overrides` changes optimisation settings (OPTIM_FIELDS) of a resumed run;
    its architecture always comes from the checkpoint.
    """
    run_dir = Path(run_dir)
    ckpt_path = run_dir / "ckpt.pt"
    tokenizer = load_tokenizer(target_path)
    examples = load_examples(data_dir, labels_dir, target_path, device=device, target_dtype=target_dtype)
    if not examples:
        raise ValueError(f"no generated sequences in {data_dir}; run `python tools/distill_draft.py generate` first")
    val = [e for e in examples if is_validation(e.prompt_id)][:200]
    if ckpt_path.is_file():
        state = torch.load(ckpt_path, weights_only=False, map_location="cpu")
        cfg = TrainConfig(**state["train_config"])
        for name, value in (overrides or {}).items():
            if name not in OPTIM_FIELDS:
                raise ValueError(f"{name} is fixed by the checkpoint {ckpt_path}; only {OPTIM_FIELDS} can change on resume")
            if getattr(cfg, name) != value:
                log(f"resume: {name} {getattr(cfg, name)} -> {value}")
                setattr(cfg, name, value)
        draft = Transformer(ModelConfig.from_dict(state["model_config"]))
        draft.load_state_dict(state["model"])
        draft.to(device or "cpu")
        opt = make_optimizer(draft, cfg)
        try:
            opt.load_state_dict(state["optimizer"])  # moves the moments to the parameters' device
        except ValueError as e:  # e.g. a checkpoint from before q/k/v became one fused parameter
            log(f"resume: the optimizer state does not fit this model's parameters ({e}); "
                "keeping the weights and starting the optimizer afresh")
        for g, base in zip(opt.param_groups, (cfg.embed_lr, cfg.lr, cfg.lr)):
            g["base_lr"] = base  # the optimizer state carries the old ones
        opt.param_groups[1]["weight_decay"] = cfg.weight_decay
        step, epoch, order, pos = state["step"], state["epoch"], state["order"], state["pos"]
        best = state.get("best", -1.0)
        torch.set_rng_state(state["rng"])
        log(f"resumed {ckpt_path}: step {step}, epoch {epoch}, batch {pos}/{len(order)}")
    else:
        cfg = cfg or TrainConfig()
        if init_from is not None:  # continue from an exported draft: its architecture and head, fresh optimizer
            draft = Transformer.from_pretrained(init_from, dtype=torch.float32)
            # the same vocabulary and tokenizer checks speculate makes
            check_compatible(SimpleNamespace(config=ModelConfig.load(str(Path(target_path) / "config.json")),
                                             tokenizer=tokenizer), draft)
            if draft.head_ids is None:
                raise ValueError(f"{init_from} has no subset head (head_ids); --init-from needs a draft made by this tool")
            c = draft.config
            cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads = c.dim, c.n_layers, c.n_heads, c.n_kv_heads
            cfg.ffn_dim, cfg.head_vocab = c.ffn_dim, len(draft.head_ids)
            draft = draft.to(device or "cpu")
            log(f"new run initialised from {init_from}")
        else:
            train_ex = [e for e in examples if not is_validation(e.prompt_id)]
            draft = build_draft(cfg, target_path, train_ex).to(device or "cpu")
        opt = make_optimizer(draft, cfg)
        step, epoch, order, pos, best = 0, 0, None, 0, -1.0
        torch.manual_seed(cfg.seed)
    head_index = torch.full((draft.config.vocab_size,), -1, dtype=torch.long)
    head_index[draft.head_ids.cpu()] = torch.arange(len(draft.head_ids))
    by_key = {e.key: e for e in examples}
    n_params = sum(p.numel() for p in draft.parameters())
    log(f"draft {draft.config.dim}d x {draft.config.n_layers} layers, head {len(draft.head_ids)}, {n_params / 1e6:.1f}M "
        f"params; {len(examples)} sequences, {sum(len(e.label_ids) for e in examples)} response tokens, {len(val)} held for validation")

    def checkpoint():
        save_checkpoint(ckpt_path, {"model": draft.state_dict(), "optimizer": opt.state_dict(), "step": step,
                                    "epoch": epoch, "order": order, "pos": pos, "best": best,
                                    "rng": torch.get_rng_state(), "model_config": draft.config.to_dict(),
                                    "train_config": cfg.__dict__})

    start = time.time()
    last_ckpt, last_export = time.time(), 0.0
    metrics_file = run_dir / "train.jsonl"
    run_dir.mkdir(parents=True, exist_ok=True)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(desc="train", unit="step", file=sys.stderr, mininterval=20, initial=step)
    ema = None
    last_val = {}
    stop = False
    while not stop:
        if order is None or pos >= len(order):
            if order is not None:  # a finished epoch: pick up newly generated shards
                if min_growth > 0:  # pace training to the generator: another pass only once the data has grown
                    checkpoint()  # (a restart while waiting resumes here: at the end of the finished epoch)
                epoch += 1
                if min_growth > 0:
                    examples, waited = wait_for_growth(examples, min_growth, data_dir, labels_dir, target_path,
                                                       deadline=start + 60 * minutes if minutes else None,
                                                       target_dtype=target_dtype)
                    if waited:
                        log(f"waited {waited:.0f}s for {min_growth:.0%} more data")
                else:
                    examples = load_examples(data_dir, labels_dir, target_path, device=device, target_dtype=target_dtype)
                by_key = {e.key: e for e in examples}
            train_ex = [e for e in examples if not is_validation(e.prompt_id)]
            order, pos = epoch_order(train_ex, epoch, cfg.max_tokens, cfg.seed), 0
            log(f"epoch {epoch}: {len(train_ex)} sequences, {len(order)} batches")
        keys = [k for k in order[pos] if k in by_key]
        pos += 1
        if not keys:
            continue
        draft.train()
        b = to_device(make_batch([by_key[k] for k in keys], head_index), draft.device)
        scale = min(1.0, (step + 1) / cfg.warmup)
        for g in opt.param_groups:
            g["lr"] = g["base_lr"] * scale
        with torch.autocast(draft.device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = draft_head_logits(draft, b["x"])
        loss, m = distill_loss(logits, b, cfg.hard_weight)  # in float32 either way
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step += 1
        ema = m if ema is None else {k: 0.98 * ema[k] + 0.02 * m[k] for k in ("soft", "hard", "agree")}
        if bar is not None:
            bar.update(1)
            bar.set_postfix(ep=epoch, soft=f"{ema['soft']:.3f}", agree=f"{ema['agree']:.3f}", refresh=False)
        stop = ((minutes is not None and time.time() - start > 60 * minutes) or (max_steps is not None and step >= max_steps)
                or STOP_REQUESTED)
        if step % eval_every == 0 or stop:
            last_val = evaluate(draft, val, head_index, cfg) if val else {}
            rec = {"step": step, "epoch": epoch, "time": round(time.time() - start), "train_soft": ema["soft"],
                   "train_agree": ema["agree"], **{f"val_{k}": v for k, v in last_val.items()}}
            with open(metrics_file, "a") as f:
                f.write(json.dumps(rec) + "\n")
            log(json.dumps(rec))
            if export_to is not None and last_val and last_val["agree"] > best and time.time() - last_export > 60 * export_minutes:
                best = last_val["agree"]
                export_draft(draft, tokenizer, export_to, {"step": step, "epoch": epoch, **last_val})
                last_export = time.time()
                log(f"exported the draft to {export_to} (validation agreement {best:.4f})")
        if time.time() - last_ckpt > 60 * ckpt_minutes:
            checkpoint()
            last_ckpt = time.time()
    checkpoint()
    if bar is not None:
        bar.close()
    return last_val


def load_run_draft(run_dir: str | Path) -> Transformer:
    state = torch.load(Path(run_dir) / "ckpt.pt", weights_only=False, map_location="cpu")
    draft = Transformer(ModelConfig.from_dict(state["model_config"]))
    draft.load_state_dict(state["model"])
    return draft


# ---------------------------------------------------------------- 4. measure


def heldout_prompts(prompts: list[dict], n: int) -> list[dict]:
    """n held-out prompts: a fixed spread over the templated ones plus every hand-written one, up to n."""
    held = [p for p in prompts if p["split"] == "heldout"]
    free = [p for p in held if p["kind"] == "freeform"]
    templ = [p for p in held if p["kind"] != "freeform"]
    n_free = min(len(free), n // 4)
    step = max(1, len(templ) // max(1, n - n_free))
    return templ[::step][: n - n_free] + free[:n_free]


def simulate_greedy_rounds(agree: list[bool], k: int, budget: int | None = None) -> tuple[int, int, int]:
    """Greedy speculation replayed on a teacher-forced agreement sequence: (rounds, drafted, accepted).

    With greedy decoding the committed text is the target's greedy text, and
    the draft's proposal at each position is its argmax given that text; a
    proposal after a rejection is never made. So agree[j] (draft argmax ==
    target token at response position j) determines every round exactly: a
    round at j accepts the run of agreements (at most k), then the target adds
    one token (the correction or the bonus). As in `speculate`, a round never
    drafts past the token budget (`budget` = max_new_tokens, default len(agree)):
    with r tokens left it drafts min(k, r - 1), the target adding the last.
    """
    j = rounds = drafted = accepted = 0
    n = len(agree)
    budget = n if budget is None else budget
    while j < n:
        kk = max(0, min(k, budget - j - 1))
        m = 0
        while m < kk and j + m < n and agree[j + m]:
            m += 1
        rounds += 1
        drafted += kk
        accepted += m
        j += m + 1
    return rounds, drafted, accepted


@torch.inference_mode()
def step_cost(model: Transformer, context: int = 128, n: int = 40, warmup: int = 5) -> list[float]:
    """Seconds of one single-token decode step (batch 1) at `context` tokens, n repeats."""
    context = min(context, model.config.max_seq_len - 1)
    cache = model.new_cache(num_blocks=-(-(context + 2) // 16) + 1, block_size=16)
    seq = cache.new_sequence()
    model.step(cache, [seq], [[int(t) for t in torch.randint(3, min(1000, model.config.vocab_size), (context,))]])
    times = []
    for i in range(warmup + n):
        t0 = time.perf_counter()
        model.step(cache, [seq], [[3]])
        dt = time.perf_counter() - t0
        cache.truncate(seq, context)
        if i >= warmup:
            times.append(dt)
    return times


def measure_stage(target_path: str, draft_path: str, prompts: list[dict], n_prompts: int = 32, k: int = 4,
                  max_new_tokens: int = 128, use_speculate: bool = True, cost_repeats: int = 40) -> dict:
    """Greedy acceptance on held-out prompts and the draft/target decode-step cost ratio."""
    target = Transformer.from_pretrained(target_path)
    draft = Transformer.from_pretrained(draft_path, dtype=torch.float32)
    tok = target.tokenizer
    chosen = heldout_prompts(prompts, n_prompts)
    ids = [render_prompt(tok, p["messages"]) for p in chosen]
    res: dict = {"prompts": len(ids), "k": k, "max_new_tokens": max_new_tokens, "threads": torch.get_num_threads()}

    t0 = time.time()
    greedy = target.generate(ids, max_new_tokens=max_new_tokens, temperature=0.0)
    res["target_generate_s"] = round(time.time() - t0, 1)
    # teacher-forced replay: the draft's argmax at every response position of the target's greedy text
    rounds = drafted = accepted = agree_n = total = 0
    by_kind: dict[str, list[int]] = {}
    for p, prompt, resp in zip(chosen, ids, greedy):
        if not resp:
            continue
        x = torch.tensor([prompt + resp[:-1]])
        pred = draft(x)[0, len(prompt) - 1:].argmax(-1).tolist()
        agree = [a == b for a, b in zip(pred, resp)]
        r, d, a = simulate_greedy_rounds(agree, k, max_new_tokens)
        rounds, drafted, accepted = rounds + r, drafted + d, accepted + a
        agree_n, total = agree_n + sum(agree), total + len(agree)
        kb = by_kind.setdefault(p["kind"], [0, 0])
        kb[0] += sum(agree)
        kb[1] += len(agree)
    res["replay"] = {"top1_agreement": agree_n / max(total, 1), "acceptance_rate": accepted / max(drafted, 1),
                     "tokens_per_round": total / max(rounds, 1), "tokens": total, "rounds": rounds,
                     "drafted": drafted, "accepted": accepted,
                     "agreement_by_kind": {kk: round(v[0] / max(v[1], 1), 4) for kk, v in by_kind.items()}}
    log(f"replay: {res['replay']}")
    if use_speculate:
        try:
            t0 = time.time()
            out = target.speculate(draft, ids, k=k, max_new_tokens=max_new_tokens, temperature=0.0)
            st = out.stats
            res["speculate"] = {"acceptance_rate": st.acceptance_rate, "mean_accepted": st.mean_accepted,
                                "sequence_rounds": st.sequence_rounds, "committed": st.committed,
                                "drafted": st.drafted, "accepted": st.accepted,
                                "position_acceptance": [round(a, 4) for a in st.position_acceptance],
                                "matches_greedy": out.tokens == greedy, "seconds": round(time.time() - t0, 1)}
            log(f"speculate: {res['speculate']}")
        except Exception as e:  # the library may not have speculate yet, or it may fail: report, keep the replay
            res["speculate"] = {"error": f"{type(e).__name__}: {e}"}
            log(f"speculate failed: {res['speculate']['error']}")
    # decode-step cost, interleaved so both see the same machine load
    tt, td, td16 = [], [], []
    draft16 = Transformer.from_pretrained(draft_path)  # as stored (bf16)
    for _ in range(4):
        tt += step_cost(target, n=cost_repeats // 4)
        td += step_cost(draft, n=cost_repeats // 4)
        td16 += step_cost(draft16, n=cost_repeats // 4)
    med = lambda v: float(np.median(v))  # noqa: E731
    res["step_ms"] = {"target_fp32": round(1e3 * med(tt), 2), "draft_fp32": round(1e3 * med(td), 2),
                      "draft_bf16": round(1e3 * med(td16), 2)}
    res["cost_ratio_fp32"] = round(med(td) / med(tt), 4)
    res["cost_ratio_bf16"] = round(med(td16) / med(tt), 4)
    a, c = res["replay"]["acceptance_rate"], res["cost_ratio_fp32"]
    # DESIGN.md's cost model: (1 - a^(k+1)) / (1 - a) tokens per round for k*c + 1 target steps
    res["modelled_speedup"] = round(res["replay"]["tokens_per_round"] / (k * c + 1), 3)
    log(f"step cost: {res['step_ms']}, ratio fp32 {res['cost_ratio_fp32']}, bf16 {res['cost_ratio_bf16']}")
    return res


# ---------------------------------------------------------------- CLI


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


STOP_REQUESTED = False  # set by SIGTERM / Ctrl-C during `train`: finish the step, checkpoint, stop


def _request_stop(signum, frame):
    global STOP_REQUESTED
    if STOP_REQUESTED:  # a second signal: stop at once (the last periodic checkpoint stays)
        raise KeyboardInterrupt(f"signal {signum}")
    STOP_REQUESTED = True
    log("stopping after this step (send the signal again to stop at once)")


def cmd_generate(args) -> None:
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` flushes the finished sequences like Ctrl-C does
    set_threads(args.threads)
    torch.manual_seed(0)
    target = Transformer.from_pretrained(args.target, device=args.device, dtype=DTYPES[args.target_dtype])
    prompts = load_prompts(args.prompts)
    generate_stage(target, prompts, args.data, args.labels, batch=args.batch, max_new_tokens=args.max_new_tokens,
                   sample_every=args.sample_every, temperature=args.temperature, samples=args.samples,
                   flush_every=args.flush_every,
                   minutes=args.minutes, max_items=args.max_items, refill=args.refill)


def cmd_train(args) -> None:
    signal.signal(signal.SIGTERM, _request_stop)
    signal.signal(signal.SIGINT, _request_stop)
    set_threads(args.threads)
    given = {f: getattr(args, f) for f in TrainConfig.__dataclass_fields__ if getattr(args, f) is not None}
    cfg = TrainConfig(**given)
    overrides = {f: v for f, v in given.items() if f in OPTIM_FIELDS}  # applied when resuming a run
    train_stage(args.run, args.data, args.labels, args.target, cfg, minutes=args.minutes, max_steps=args.max_steps,
                ckpt_minutes=args.ckpt_minutes, export_to=args.export or None, export_minutes=args.export_minutes,
                eval_every=args.eval_every, min_growth=args.min_growth, overrides=overrides, device=args.device,
                target_dtype=DTYPES[args.target_dtype], init_from=args.init_from,
                autocast=args.bf16_autocast)


def cmd_export(args) -> None:
    draft = load_run_draft(args.run)
    state = torch.load(Path(args.run) / "ckpt.pt", weights_only=False)
    export_draft(draft, load_tokenizer(args.target), args.out, {"step": state["step"], "epoch": state["epoch"]})
    log(f"wrote {args.out}")


def cmd_measure(args) -> None:
    set_threads(args.threads)
    res = measure_stage(args.target, args.draft, load_prompts(args.prompts), n_prompts=args.n_prompts, k=args.k,
                        max_new_tokens=args.max_new_tokens, use_speculate=not args.no_speculate)
    text = json.dumps(res, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


def cmd_all(args) -> None:
    """generate, then train (exporting the best draft to --out), then optionally measure: each stage resumes."""
    common = ["--target", args.target, "--threads", str(args.threads), "--target-dtype", args.target_dtype]
    common += ["--device", args.device] if args.device else []
    data = ["--data", args.data, "--labels", args.labels]
    minutes = lambda m: ["--minutes", str(m)] if m is not None else []  # noqa: E731
    main(["generate", *common, *data, "--prompts", args.prompts, *minutes(args.gen_minutes)])
    target_dim = ModelConfig.load(str(Path(args.target) / "config.json")).dim
    arch = ["--dim", str(args.dim or min(TrainConfig.dim, target_dim))]  # the embedding is projected: dim <= target's
    arch += ["--n-layers", str(args.n_layers)] if args.n_layers else []
    arch += ["--head-vocab", str(args.head_vocab)] if args.head_vocab else []
    main(["train", *common, *data, "--run", args.run, "--export", args.out, *minutes(args.train_minutes), *arch])
    if args.measure:
        main(["measure", "--target", args.target, "--draft", args.out, "--prompts", args.prompts,
              "--threads", str(args.threads)])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0].startswith("--") and argv[0] not in ("--help",):
        argv = ["all", *argv]  # python tools/distill_draft.py --target DIR --out DIR: the whole pipeline
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    a = sub.add_parser("all", help="the whole pipeline: generate, train, export to --out (and --measure); "
                                   "also what runs when the first argument is an option")
    a.add_argument("--target", default=TARGET)
    a.add_argument("--out", default=DRAFT_OUT, help="where the best draft goes")
    a.add_argument("--data", default=DATA, help="target text shards (one directory per target)")
    a.add_argument("--labels", default=LABELS)
    a.add_argument("--run", default=RUN, help="training checkpoints")
    a.add_argument("--prompts", default=PROMPTS)
    a.add_argument("--gen-minutes", type=float, default=None, help="stop generating after this long (default: all prompts)")
    a.add_argument("--train-minutes", type=float, default=None, help="stop training after this long (default: never)")
    a.add_argument("--dim", type=int, default=None,
                   help=f"draft width for a new run (default {TrainConfig.dim}, at most the target's)")
    a.add_argument("--n-layers", type=int, default=None, help=f"draft depth for a new run (default {TrainConfig.n_layers})")
    a.add_argument("--head-vocab", type=int, default=None, help=f"draft head size for a new run (default {TrainConfig.head_vocab})")
    a.add_argument("--measure", action="store_true", help="measure acceptance on held-out prompts at the end")
    a.add_argument("--threads", type=int, default=2)
    a.add_argument("--device", default=None, help="e.g. cuda (default: cpu)")
    a.add_argument("--target-dtype", choices=DTYPES, default="float32",
                   help="the target's dtype while generating text and soft labels")
    a.set_defaults(func=cmd_all)

    g = sub.add_parser("generate", help="target responses to the prompts -> data/distill shards")
    g.add_argument("--target", default=TARGET)
    g.add_argument("--data", default=DATA)
    g.add_argument("--labels", default=LABELS)
    g.add_argument("--prompts", default=PROMPTS)
    g.add_argument("--refill", type=int, default=8, help="admit new prompts when this many batch slots are free")
    g.add_argument("--batch", type=int, default=64)
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--sample-every", type=int, default=3, help="also sample every n-th prompt at --temperature")
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--samples", type=int, default=1, help="sampled answers per sampled prompt (more target text)")
    g.add_argument("--flush-every", type=int, default=128, help="write a shard every n finished sequences")
    g.add_argument("--minutes", type=float, default=None, help="stop after this many minutes")
    g.add_argument("--max-items", type=int, default=None)
    g.add_argument("--threads", type=int, default=2)
    g.add_argument("--device", default=None, help="e.g. cuda (default: cpu)")
    g.add_argument("--target-dtype", choices=DTYPES, default="float32", help="the target's dtype while generating")
    g.set_defaults(func=cmd_generate)

    t = sub.add_parser("train", help="distil the draft (resumes from RUN/ckpt.pt)")
    t.add_argument("--run", default=RUN)
    t.add_argument("--target", default=TARGET)
    t.add_argument("--data", default=DATA)
    t.add_argument("--labels", default=LABELS)
    t.add_argument("--minutes", type=float, default=None)
    t.add_argument("--max-steps", type=int, default=None)
    t.add_argument("--ckpt-minutes", type=float, default=5.0)
    t.add_argument("--export", default=DRAFT_OUT, help="write the best draft here ('' = never)")
    t.add_argument("--export-minutes", type=float, default=0.0, help="at least this long between exports")
    t.add_argument("--eval-every", type=int, default=200)
    t.add_argument("--min-growth", type=float, default=0.0,
                   help="start a new epoch only when the data has grown by this fraction (when a generator runs alongside)")
    t.add_argument("--threads", type=int, default=2)
    t.add_argument("--device", default=None, help="e.g. cuda (default: cpu)")
    t.add_argument("--target-dtype", choices=DTYPES, default="float32",
                   help="the target's dtype when soft labels must be recomputed")
    t.add_argument("--bf16-autocast", action="store_true",
                   help="run the draft's matrix products in bfloat16 (weights and optimizer stay float32); "
                        "faster on CPUs with AMX and on GPUs")
    t.add_argument("--init-from", default=None,
                   help="start a new run from this exported draft (its architecture and head) instead of from the "
                        "target's embedding; ignored when the run directory already has a checkpoint")
    for f in TrainConfig.__dataclass_fields__.values():
        # architecture: for a new run only; optimisation (OPTIM_FIELDS): also changes a resumed run when given
        t.add_argument("--" + f.name.replace("_", "-"), type=float if isinstance(f.default, float) else int,
                       default=None, help=f"default {f.default}")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("export", help="RUN/ckpt.pt -> a bf16 draft checkpoint with the target's tokenizer")
    e.add_argument("--run", default=RUN)
    e.add_argument("--target", default=TARGET)
    e.add_argument("--out", default=DRAFT_OUT)
    e.set_defaults(func=cmd_export)

    m = sub.add_parser("measure", help="acceptance on held-out prompts and the step-cost ratio")
    m.add_argument("--target", default=TARGET)
    m.add_argument("--draft", default=DRAFT_OUT)
    m.add_argument("--prompts", default=PROMPTS)
    m.add_argument("--n-prompts", type=int, default=32)
    m.add_argument("--k", type=int, default=4)
    m.add_argument("--max-new-tokens", type=int, default=128)
    m.add_argument("--no-speculate", action="store_true")
    m.add_argument("--out", default=None, help="also write the figures to this JSON file")
    m.add_argument("--threads", type=int, default=2)
    m.set_defaults(func=cmd_measure)

    args = ap.parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
