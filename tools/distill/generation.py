"""Stage 1, generate: the target answers the train prompts; finished answers become shards.

Sequences run through the target's paged KV cache with continuous batching
(`ContinuousBatch`): a finished sequence frees its blocks and a new prompt
takes its place, so the batch stays full. The target's top-k log-probabilities
at every generated position come for free from the decode logits and are
written beside each shard (`ShardWriter`). A restart skips every
(prompt, temperature, seed) already in a shard.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from minispec import Transformer
from minispec.sampling import SamplingParams, logits_to_probs, make_generators, sample

from .common import TOPK, DataError, log
from .data import Shard, check_data_target, done_keys, item_key, labels_path, save_labels, shard_paths, topk_logprobs


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


@dataclass
class Running:
    """A sequence decoding in the batch: its work item, its cache sequence, its tokens and soft labels so far."""

    prompt_id: int
    temperature: float
    seed: int
    prompt: list[int]
    seq: int  # its sequence in the paged cache
    skip: int  # prompt tokens already in the cache (the forked shared prefix)
    params: SamplingParams
    gen: torch.Generator
    response: list[int] = field(default_factory=list)
    label_ids: list[np.ndarray] = field(default_factory=list)
    label_logp: list[np.ndarray] = field(default_factory=list)


class ContinuousBatch:
    """Up to `size` sequences decoding together in one paged cache of the target.

    The cache holds `size` sequences of the longest of `first_prompts` (at least
    256 tokens) plus `max_new_tokens`. Every chat prompt starts with the same
    system header: its whole blocks are prefilled once and forked (the paged
    cache shares them), so each new prompt prefills only its own part.
    """

    BLOCK = 16

    def __init__(self, target: Transformer, size: int, max_new_tokens: int, first_prompts: list[list[int]],
                 topk: int = TOPK):
        self.target, self.size, self.max_new_tokens, self.topk = target, size, max_new_tokens, topk
        self.stops = set(target.config.stop_ids)
        self.per_seq = -(-(max(max(map(len, first_prompts)), 256) + max_new_tokens) // self.BLOCK)
        self.cache = target.new_cache(num_blocks=size * self.per_seq + 8, block_size=self.BLOCK)
        self.prefix, self.root = [], None
        prefix = shared_prefix(first_prompts)
        if len(prefix) >= self.BLOCK:
            self.prefix = prefix[: len(prefix) // self.BLOCK * self.BLOCK]  # whole blocks: no copy-on-write on fork
            self.root = self.cache.new_sequence()
            target.step(self.cache, [self.root], [self.prefix])
        self.active: list[Running] = []
        self.logits: torch.Tensor | None = None  # (len(active), V): what each active sequence samples next
        self.n_tokens = 0

    def fits(self, ids: list[int]) -> bool:
        return len(ids) + self.max_new_tokens <= self.per_seq * self.BLOCK

    def start(self, item: tuple[int, float, int], ids: list[int]) -> Running:
        """A new sequence for the work item, forked from the shared prefix when its prompt starts with it."""
        pid, temp, seed = item
        forked = self.root is not None and ids[: len(self.prefix)] == self.prefix and len(ids) > len(self.prefix)
        return Running(pid, temp, seed, ids, seq=self.cache.fork(self.root) if forked else self.cache.new_sequence(),
                       skip=len(self.prefix) if forked else 0, params=SamplingParams(temp),
                       gen=make_generators(seed, 1)[0])

    def fill(self, queue: list[tuple[int, float, int]], prompt_ids) -> None:
        """Take work items from the end of `queue` until the batch is full and prefill them together;
        they join after the sequences already decoding. `prompt_ids(prompt id)` gives a prompt's ids."""
        new = []
        while queue and len(self.active) + len(new) < self.size:
            item = queue.pop()
            ids = prompt_ids(item[0])
            if not self.fits(ids):
                log(f"skipping prompt {item[0]}: {len(ids)} tokens do not fit the cache layout")
                continue
            new.append(self.start(item, ids))
        if new:
            logits = self.target.step(self.cache, [r.seq for r in new], [r.prompt[r.skip:] for r in new])
            self.logits = logits if not self.active else torch.cat([self.logits, logits])
            self.active += new

    def sample(self, drop_unfinished: bool = False) -> list[Running]:
        """One token for every active sequence from its logits; return those that finished (a stop token or
        max_new_tokens), freeing their cache. With drop_unfinished (out of time) the others are dropped too."""
        ids_k, logp_k = (t.cpu() for t in topk_logprobs(self.logits, self.topk))
        finished, still = [], []
        for row, r in enumerate(self.active):
            if r.params.greedy:
                t = int(self.logits[row].argmax())
            else:
                t = sample(logits_to_probs(self.logits[row], r.params), r.gen)
            r.response.append(t)
            r.label_ids.append(ids_k[row].numpy())
            r.label_logp.append(logp_k[row].numpy())
            self.n_tokens += 1
            done = t in self.stops or len(r.response) >= self.max_new_tokens
            (finished if done else still).append(r)
            if done or drop_unfinished:
                self.cache.free(r.seq)  # a dropped sequence is redone by the next run
        self.active = [] if drop_unfinished else still
        return finished

    def decode(self) -> None:
        """Run the target on the last token of every active sequence (its logits for the next `sample`)."""
        if self.active:
            self.logits = self.target.step(self.cache, [r.seq for r in self.active],
                                           [[r.response[-1]] for r in self.active])


class ShardWriter:
    """Finished sequences and their soft labels, written as the next shard (and its label file) every
    `every` sequences or `seconds`, and on `flush`. Shards are never overwritten."""

    def __init__(self, data_dir: Path, labels_dir: Path, every: int, seconds: float):
        self.data_dir, self.labels_dir, self.every, self.seconds = data_dir, labels_dir, every, seconds
        self.next_number = len(shard_paths(data_dir))
        self.added = 0
        self._reset()

    def _reset(self) -> None:
        self.seqs: list[dict] = []
        self.ids: list[np.ndarray] = []
        self.logp: list[np.ndarray] = []
        self.last_flush = time.time()

    def add(self, r: Running) -> None:
        self.seqs.append({"prompt_id": r.prompt_id, "temperature": r.temperature, "seed": r.seed,
                          "prompt": r.prompt, "response": r.response})
        self.ids.append(np.stack(r.label_ids))
        self.logp.append(np.stack(r.label_logp))
        self.added += 1

    def due(self) -> bool:
        return len(self.seqs) >= self.every or (bool(self.seqs) and time.time() - self.last_flush > self.seconds)

    def _free_path(self) -> Path:
        """The next shard name no other writer took."""
        while True:
            path = self.data_dir / f"gen-{self.next_number:05d}.npz"
            self.next_number += 1
            if not path.exists():
                return path

    def flush(self) -> None:
        if self.seqs:
            path = self._free_path()
            save_labels(labels_path(self.labels_dir, path), np.concatenate(self.ids), np.concatenate(self.logp))
            Shard.from_sequences(self.seqs).save(path)
            log(f"wrote {path} ({len(self.seqs)} sequences, {sum(len(s['response']) for s in self.seqs)} tokens)")
        self._reset()


def pending_items(prompts: list[dict], data_dir: Path, sample_every: int, temperature: float, samples: int,
                  max_items: int | None) -> list[tuple[int, float, int]]:
    """The work items not yet in a shard of data_dir, in file order (at most max_items)."""
    done = done_keys(data_dir)
    todo = [it for it in work_items(prompts, sample_every, temperature, samples) if item_key(*it) not in done]
    todo = todo if max_items is None else todo[:max_items]
    log(f"generate: {len(done)} sequences already in {data_dir}, {len(todo)} to go")
    return todo


def decode_all(batch: ContinuousBatch, writer: ShardWriter, queue: list, prompt_ids, refill: int,
               deadline: float | None, bar: tqdm) -> None:
    """Decode until `queue` (taken from its end) and the batch are empty or the deadline passes, admitting new
    prompts whenever `refill` slots are free; finished sequences go to `writer`, those in flight at the
    deadline are dropped."""
    t_start = time.time()
    while queue or batch.active:
        out_of_time = deadline is not None and time.time() > deadline
        if queue and not out_of_time and (not batch.active or batch.size - len(batch.active) >= refill):
            batch.fill(queue, prompt_ids)
        if not batch.active:
            if out_of_time:
                break
            continue
        for r in batch.sample(drop_unfinished=out_of_time):
            writer.add(r)
            bar.update(1)
            bar.set_postfix(tok=batch.n_tokens, tok_s=f"{batch.n_tokens / (time.time() - t_start):.1f}", refresh=False)
        if writer.due():
            writer.flush()
        batch.decode()


def generate_stage(target: Transformer, prompts: list[dict], data_dir: str | Path, labels_dir: str | Path,
                   batch: int = 64, max_new_tokens: int = 256, sample_every: int = 3, temperature: float = 0.7,
                   samples: int = 1, flush_every: int = 128, flush_seconds: float = 300.0, minutes: float | None = None,
                   max_items: int | None = None, topk: int = TOPK, refill: int = 8, progress: bool = True) -> int:
    """Generate target responses for every train prompt not yet in a shard; returns the number of new sequences.

    Continuous batching over one paged cache: up to `batch` sequences decode
    together; whenever `refill` slots are free (or the batch is empty) new
    prompts are prefilled together and join. Stops after `minutes` (finishing
    nothing in flight: unfinished sequences are simply redone next time).
    Ctrl-C (or SIGTERM, which the command line turns into it) writes every
    finished sequence before it propagates.
    """
    data_dir, labels_dir = Path(data_dir), Path(labels_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    tok = target.tokenizer
    if tok is None:
        raise DataError("the target checkpoint has no tokenizer files; generate needs them to apply the chat template")
    check_data_target(data_dir, target.config, tok, create=True)
    todo = pending_items(prompts, data_dir, sample_every, temperature, samples, max_items)
    if not todo:
        return 0
    rendered: dict[int, list[int]] = {}

    def prompt_ids(pid: int) -> list[int]:
        if pid not in rendered:
            rendered[pid] = tok.encode_chat(prompts[pid]["messages"])
        return rendered[pid]

    decoder = ContinuousBatch(target, batch, max_new_tokens, [prompt_ids(pid) for pid, _, _ in todo[: batch * 4]], topk)
    writer = ShardWriter(data_dir, labels_dir, flush_every, flush_seconds)
    bar = tqdm(total=len(todo), unit="seq", desc="generate", file=sys.stderr, mininterval=20, smoothing=0.05,
               disable=not progress)
    t_start = time.time()
    try:
        decode_all(decoder, writer, list(reversed(todo)), prompt_ids, refill,  # reversed: pop() takes file order
                   time.time() + 60 * minutes if minutes else None, bar)
    except KeyboardInterrupt:  # keep every finished sequence; only those in flight are redone
        log("interrupted: writing the finished sequences")
        writer.flush()
        raise
    finally:
        bar.close()
    writer.flush()
    dt, n = time.time() - t_start, decoder.n_tokens
    log(f"generate: {writer.added} sequences, {n} tokens in {dt:.0f}s ({n / max(dt, 1e-9):.1f} tokens/s)")
    return writer.added
