"""Stage 2, train: the draft learns from the target's soft labels (renormalised top-k) and hard next tokens.

A run directory holds ckpt.pt (see checkpoint.py) and train.jsonl (metrics).
Each epoch re-reads the shards, so data generated meanwhile joins at the next
epoch; a restart resumes from the checkpoint bit for bit (same batches, same
weights as a run never stopped).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from minispec import ModelConfig, Transformer
from minispec.tokenizer import load_tokenizer

from .checkpoint import CKPT_NAME, draft_from_checkpoint, load_checkpoint, save_checkpoint, unusable
from .common import DATA, LABELS, TARGET, TOPK, DataError, log
from .data import Example, is_validation, load_examples, n_tokens
from .draft import build_draft, draft_head_logits, export_draft, load_exported_draft


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


OPTIM_FIELDS = ("lr", "embed_lr", "warmup", "weight_decay", "hard_weight", "max_tokens")  # may change on resume


# ---------------------------------------------------------------- batches and loss


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


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


def head_index_of(draft: Transformer) -> torch.Tensor:
    """(vocab,) token id -> its row in the draft's subset head, -1 for tokens outside it."""
    index = torch.full((draft.config.vocab_size,), -1, dtype=torch.long)
    index[draft.head_ids.cpu()] = torch.arange(len(draft.head_ids))
    return index


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


def make_optimizer(draft: Transformer, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW in three groups: the embedding (its own lr, no decay), matrices (decay), vectors (no decay)."""
    embed = [draft.embed_tokens.weight]
    decay = [p for n, p in draft.named_parameters() if p.dim() >= 2 and n != "embed_tokens.weight"]
    no_decay = [p for p in draft.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": embed, "lr": cfg.embed_lr, "weight_decay": 0.0, "base_lr": cfg.embed_lr},
                              {"params": decay, "lr": cfg.lr, "weight_decay": cfg.weight_decay, "base_lr": cfg.lr},
                              {"params": no_decay, "lr": cfg.lr, "weight_decay": 0.0, "base_lr": cfg.lr}],
                             betas=(0.9, 0.98), eps=1e-8)


# ---------------------------------------------------------------- the run and its data


@dataclass
class Run:
    """A training run's state: the draft, its optimizer, and where it stands (what ckpt.pt holds)."""

    draft: Transformer
    opt: torch.optim.Optimizer
    cfg: TrainConfig
    step: int = 0
    epoch: int = 0
    order: list | None = None  # the epoch's batches of example keys
    pos: int = 0  # the next batch in `order`
    best: float = -1.0  # the best validation agreement exported so far

    def save(self, path: Path) -> None:
        save_checkpoint(path, {"model": self.draft.state_dict(), "optimizer": self.opt.state_dict(),
                               "step": self.step, "epoch": self.epoch, "order": self.order, "pos": self.pos,
                               "best": float(self.best), "rng": torch.get_rng_state(),
                               "model_config": self.draft.config.to_dict(), "train_config": asdict(self.cfg)})


def resume_run(ckpt_path: Path, overrides: dict | None, device: str | None) -> Run:
    """The run saved in ckpt_path, with `overrides` (OPTIM_FIELDS only) applied; the RNG continues where it was."""
    state = load_checkpoint(ckpt_path)
    try:
        cfg = TrainConfig(**state["train_config"])
    except TypeError as e:
        raise unusable(ckpt_path, f"its train_config cannot be used ({e})") from None
    for name, value in (overrides or {}).items():
        if name not in OPTIM_FIELDS:
            raise ValueError(f"{name} is fixed by the checkpoint {ckpt_path}; only {OPTIM_FIELDS} can change on resume")
        if getattr(cfg, name) != value:
            log(f"resume: {name} {getattr(cfg, name)} -> {value}")
            setattr(cfg, name, value)
    draft = draft_from_checkpoint(state, ckpt_path).to(device or "cpu")
    opt = make_optimizer(draft, cfg)
    try:
        opt.load_state_dict(state["optimizer"])  # moves the moments to the parameters' device
    except ValueError as e:  # a checkpoint from before q/k/v became one fused parameter
        log(f"resume: the optimizer state does not fit this model's parameters ({e}); "
            "keeping the weights and starting the optimizer afresh")
    for g, base in zip(opt.param_groups, (cfg.embed_lr, cfg.lr, cfg.lr)):
        g["base_lr"] = base  # the optimizer state carries the old ones
    opt.param_groups[1]["weight_decay"] = cfg.weight_decay
    torch.set_rng_state(state["rng"])
    run = Run(draft, opt, cfg, state["step"], state["epoch"], state["order"], state["pos"], state["best"])
    log(f"resumed {ckpt_path}: step {run.step}, epoch {run.epoch}, batch {run.pos}/{len(run.order or [])}")
    return run


def new_run(cfg: TrainConfig, train_examples: list[Example], target_path: str, tokenizer,
            init_from: str | Path | None, device: str | None) -> Run:
    """A fresh run: a new draft built from the target, or (init_from) an exported draft with its architecture."""
    if init_from is not None:  # its architecture and head, fresh optimizer
        target_config = ModelConfig.load(str(Path(target_path) / "config.json"))
        draft = load_exported_draft(init_from, target_config, tokenizer)
        c = draft.config
        cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads = c.dim, c.n_layers, c.n_heads, c.n_kv_heads
        cfg.ffn_dim, cfg.head_vocab = c.ffn_dim, len(draft.head_ids)
        log(f"new run initialised from {init_from}")
    else:
        draft = build_draft(target_path, train_examples, cfg.seed, cfg.dim, cfg.n_layers, cfg.n_heads,
                            cfg.n_kv_heads, cfg.ffn_dim, cfg.head_vocab)
    draft = draft.to(device or "cpu")
    opt = make_optimizer(draft, cfg)
    torch.manual_seed(cfg.seed)
    return Run(draft, opt, cfg)


class TrainingData:
    """The examples of a data directory (re-read at each epoch) and a fixed validation set from the first read."""

    def __init__(self, data_dir, labels_dir, target_path: str | None, device: str | None = None,
                 target_dtype: torch.dtype | None = None):
        self.data_dir, self.labels_dir, self.target_path = data_dir, labels_dir, target_path
        self.device, self.target_dtype = device, target_dtype
        self.reload()
        if not self.examples:
            raise DataError(f"no generated sequences in {data_dir}; run `python tools/distill_draft.py generate` first")
        self.validation = [e for e in self.examples if is_validation(e.prompt_id)][:200]

    def reload(self, examples: list[Example] | None = None) -> None:
        """Read the shards again (or take `examples`, already read)."""
        if examples is None:
            examples = load_examples(self.data_dir, self.labels_dir, self.target_path, device=self.device,
                                     target_dtype=self.target_dtype)
        self.examples = examples
        self.by_key = {e.key: e for e in examples}

    def train(self) -> list[Example]:
        return [e for e in self.examples if not is_validation(e.prompt_id)]

    def wait_for_growth(self, growth: float, deadline: float | None, poll: float = 60.0) -> float:
        """Re-read the shards until they hold `growth` x more response tokens (or the deadline passes);
        returns the seconds waited."""
        examples, waited = wait_for_growth(self.examples, growth, self.data_dir, self.labels_dir, self.target_path,
                                           deadline, poll, self.target_dtype)
        self.reload(examples)
        return waited


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


# ---------------------------------------------------------------- the loop


class StopRequest:
    """A signal handler (SIGTERM, Ctrl-C) for `train`: the first signal asks training to finish its step,
    checkpoint and return; a second stops at once (the last periodic checkpoint stays)."""

    def __init__(self):
        self.requested = False

    def __call__(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt(f"signal {signum}")
        self.requested = True
        log("stopping after this step (send the signal again to stop at once)")


@dataclass
class Schedule:
    """When training stops, evaluates, checkpoints and exports."""

    minutes: float | None = None
    max_steps: int | None = None
    ckpt_minutes: float = 5.0
    export_to: str | Path | None = None
    export_minutes: float = 0.0
    eval_every: int = 200
    min_growth: float = 0.0  # with a generator running alongside: a new epoch only once the data grew this much
    stop: StopRequest | None = None


class Trainer:
    """Runs the steps of a `Run` over `TrainingData` on a `Schedule`, writing RUN/train.jsonl and ckpt.pt."""

    def __init__(self, run: Run, data: TrainingData, run_dir: Path, tokenizer, schedule: Schedule,
                 autocast: bool = False, progress: bool = True):
        self.run, self.data, self.schedule, self.tokenizer, self.autocast = run, data, schedule, tokenizer, autocast
        self.ckpt_path, self.metrics_file = run_dir / CKPT_NAME, run_dir / "train.jsonl"
        run_dir.mkdir(parents=True, exist_ok=True)
        self.head_index = head_index_of(run.draft)
        self.start = self.last_ckpt = time.time()
        self.last_export = 0.0
        self.ema: dict | None = None
        self.bar = tqdm(desc="train", unit="step", file=sys.stderr, mininterval=20, initial=run.step,
                        disable=not progress)

    def deadline(self) -> float | None:
        return self.start + 60 * self.schedule.minutes if self.schedule.minutes else None

    def should_stop(self) -> bool:
        s = self.schedule
        return ((s.minutes is not None and time.time() - self.start > 60 * s.minutes)
                or (s.max_steps is not None and self.run.step >= s.max_steps)
                or (s.stop is not None and s.stop.requested))

    def next_epoch(self) -> None:
        """After a finished epoch, read the data again (pacing to the generator with min_growth); then shuffle."""
        run, growth = self.run, self.schedule.min_growth
        if run.order is not None:
            if growth > 0:
                run.save(self.ckpt_path)  # a restart while waiting resumes here: at the end of the finished epoch
            run.epoch += 1
            if growth > 0:
                waited = self.data.wait_for_growth(growth, self.deadline())
                if waited:
                    log(f"waited {waited:.0f}s for {growth:.0%} more data")
            else:
                self.data.reload()
        train = self.data.train()
        run.order, run.pos = epoch_order(train, run.epoch, run.cfg.max_tokens, run.cfg.seed), 0
        log(f"epoch {run.epoch}: {len(train)} sequences, {len(run.order)} batches")

    def step(self, examples: list[Example]) -> None:
        """One optimizer step on a batch: warmup, the loss in float32 (matrix products in bf16 with autocast)."""
        run = self.run
        run.draft.train()
        b = to_device(make_batch(examples, self.head_index), run.draft.device)
        scale = min(1.0, (run.step + 1) / run.cfg.warmup)
        for g in run.opt.param_groups:
            g["lr"] = g["base_lr"] * scale
        with torch.autocast(run.draft.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            logits = draft_head_logits(run.draft, b["x"])
        loss, m = distill_loss(logits, b, run.cfg.hard_weight)
        run.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(run.draft.parameters(), 1.0)
        run.opt.step()
        run.step += 1
        self.ema = m if self.ema is None else {k: 0.98 * self.ema[k] + 0.02 * m[k] for k in ("soft", "hard", "agree")}
        self.bar.update(1)
        self.bar.set_postfix(ep=run.epoch, soft=f"{self.ema['soft']:.3f}", agree=f"{self.ema['agree']:.3f}",
                             refresh=False)

    def validate(self) -> dict:
        """Validation metrics to train.jsonl; export the draft when its agreement is the best so far."""
        run, s = self.run, self.schedule
        val = evaluate(run.draft, self.data.validation, self.head_index, run.cfg) if self.data.validation else {}
        rec = {"step": run.step, "epoch": run.epoch, "time": round(time.time() - self.start),
               "train_soft": self.ema["soft"], "train_agree": self.ema["agree"],
               **{f"val_{k}": v for k, v in val.items()}}
        with open(self.metrics_file, "a") as f:
            f.write(json.dumps(rec) + "\n")
        log(json.dumps(rec))
        if (s.export_to is not None and val and val["agree"] > run.best
                and time.time() - self.last_export > 60 * s.export_minutes):
            run.best = val["agree"]
            export_draft(run.draft, self.tokenizer, s.export_to, {"step": run.step, "epoch": run.epoch, **val})
            self.last_export = time.time()
            log(f"exported the draft to {s.export_to} (validation agreement {run.best:.4f})")
        return val

    def train(self) -> dict:
        """Step until the schedule says stop; checkpoint on the way and at the end. Returns the last validation."""
        run, last_val = self.run, {}
        stop = False
        while not stop:
            if run.order is None or run.pos >= len(run.order):
                self.next_epoch()
            keys = [k for k in run.order[run.pos] if k in self.data.by_key]
            run.pos += 1
            if not keys:
                continue
            self.step([self.data.by_key[k] for k in keys])
            stop = self.should_stop()
            if run.step % self.schedule.eval_every == 0 or stop:
                last_val = self.validate()
            if time.time() - self.last_ckpt > 60 * self.schedule.ckpt_minutes:
                run.save(self.ckpt_path)
                self.last_ckpt = time.time()
        run.save(self.ckpt_path)
        self.bar.close()
        return last_val


def train_stage(run_dir: str | Path, data_dir: str | Path = DATA, labels_dir: str | Path = LABELS,
                target_path: str = TARGET, cfg: TrainConfig | None = None, minutes: float | None = None,
                max_steps: int | None = None, ckpt_minutes: float = 5.0, export_to: str | Path | None = None,
                export_minutes: float = 0.0, eval_every: int = 200, min_growth: float = 0.0,
                overrides: dict | None = None, device: str | None = None, progress: bool = True,
                target_dtype: torch.dtype | None = None, init_from: str | Path | None = None,
                autocast: bool = False, stop: StopRequest | None = None) -> dict:
    """Train (or resume training) the draft in `run_dir`; returns the last validation metrics.

    With min_growth > 0 (training beside a running generator) a new epoch starts
    only once the data has grown by that fraction, so that the CPU goes to new
    target text rather than to yet another pass over the same few sequences.
    `overrides` changes optimisation settings (OPTIM_FIELDS) of a resumed run;
    its architecture always comes from the checkpoint. `stop` (a StopRequest
    installed as a signal handler) ends training after the current step.
    """
    run_dir = Path(run_dir)
    ckpt_path = run_dir / CKPT_NAME
    tokenizer = load_tokenizer(target_path)
    data = TrainingData(data_dir, labels_dir, target_path, device, target_dtype)
    if ckpt_path.is_file():
        run = resume_run(ckpt_path, overrides, device)
    else:
        run = new_run(cfg or TrainConfig(), data.train(), target_path, tokenizer, init_from, device)
    draft = run.draft
    log(f"draft {draft.config.dim}d x {draft.config.n_layers} layers, head {len(draft.head_ids)}, "
        f"{sum(p.numel() for p in draft.parameters()) / 1e6:.1f}M params; {len(data.examples)} sequences, "
        f"{n_tokens(data.examples)} response tokens, {len(data.validation)} held for validation")
    schedule = Schedule(minutes, max_steps, ckpt_minutes, export_to, export_minutes, eval_every, min_growth, stop)
    return Trainer(run, data, run_dir, tokenizer, schedule, autocast, progress).train()
