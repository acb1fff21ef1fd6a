"""Train a feature draft (minispec.feature_draft) for a target, from the target's own hidden states.

    python tools/train_feature_draft.py collect --target DIR [--run RUN] [--gen 32] [--src 400] [--minutes M]
    python tools/train_feature_draft.py train   --target DIR [--run RUN] [--steps N] [--minutes M] [--seed 0]
    python tools/train_feature_draft.py export  --target DIR [--run RUN] --out DIR [--overwrite]
    python tools/train_feature_draft.py all     --target DIR --out DIR [--collect-minutes M] [--train-minutes M]
    python tools/train_feature_draft.py measure --target KEPT_DIR --draft DIR [--n-prompts 8] [--max-new-tokens 128]

collect (tools/feature_data.py): the target's states over its own greedy answers to the train code prompts
and over site-packages source, into RUN/data. train: the draft's layer learns, at position i, from the
target's state f_i and the embedding of token i+1, to predict f_{i+1} (smooth L1, as EAGLE) and the target's
top-k distribution of token i+2 through its head (cross-entropy, renormalised over the draft vocabulary); the
head (the target's own rows for the draft vocabulary) and the embedding stay frozen. Checkpoints (weights,
optimizer, data position, RNG) go to RUN/ckpt.pt through the distiller's atomic writer and weights-only
reader (tools/distill/checkpoint.py); a restart resumes where it stopped and the same seed gives the same
weights. Every stage resumes: kill it and run the same command again. Run it under `nice` on a shared CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from feature_data import collect, read_sequences
from tqdm import tqdm

from minispec import ModelConfig, Transformer
from minispec.cli import float_in, int_at_least
from minispec.feature_draft import FeatureDraft, build_feature_draft

from distill.checkpoint import load_checkpoint, save_checkpoint  # tools/ is on sys.path when this runs as a script
from distill.cli import exit_status
from draft_head import head_ids as frequent_head_ids

RUN = "runs/feature-draft"
# the repository's prompts, whatever the current folder
PROMPTS = str(Path(__file__).resolve().parent.parent / "data" / "distill" / "prompts.jsonl")


@dataclass
class TrainConfig:
    head_vocab: int = 8192  # the draft vocabulary: the most frequent tokens of the data, then the lowest ids
    dim: int | None = None  # the layer's width (default: the target's)
    ffn_dim: int | None = None  # its SwiGLU width (default: a sixth of the target's)
    lr: float = 1e-3
    warmup: int = 20
    weight_decay: float = 0.0
    feature_weight: float = 1.0  # smooth-L1 on the predicted state, beside the token cross-entropy
    batch: int = 4  # sequences per step
    seed: int = 0
    unroll: int = 1  # 2: also train the second drafting step on the draft's own predicted states
    decay_steps: int = 0  # the learning rate falls from lr to final_lr * lr over this many steps (cosine; 0: constant)
    final_lr: float = 0.1


def training_examples(target: Transformer, data_dir: Path) -> list[dict]:
    """Each sequence as tensors: states (T, D) float32, embeds (T, D) of the tokens, top ids and probs (T, K)."""
    out = []
    with torch.no_grad():
        for s in read_sequences(data_dir):
            if len(s["tokens"]) < 3:
                continue
            tokens = torch.from_numpy(s["tokens"].astype(np.int64))
            out.append({"name": s["name"], "states": torch.from_numpy(s["states"]).float(),
                        "embeds": target.embed_tokens(tokens).float(), "tokens": tokens,
                        "top_ids": torch.from_numpy(s["top_ids"].astype(np.int64)),
                        "top_p": torch.from_numpy(s["top_logp"]).float().exp()})
    return out


def is_validation(i: int) -> bool:
    return i % 20 == 7  # a fixed 5% of the sequences, never trained on


def make_batch(examples: list[dict], index: torch.Tensor) -> dict:
    """Entries i = 0..T-2 of each sequence (state i, embedding of token i+1), right-padded; targets: the state
    i+1 and the target's top-k of token i+2 in draft-vocabulary rows (-1: outside it)."""
    T = max(len(e["tokens"]) for e in examples) - 1
    B, D, K = len(examples), examples[0]["states"].shape[1], examples[0]["top_ids"].shape[1]
    b = {"states": torch.zeros(B, T, D), "embeds": torch.zeros(B, T, D), "next": torch.zeros(B, T, D),
         "ids": torch.zeros(B, T, K, dtype=torch.long), "p": torch.zeros(B, T, K), "top1": torch.full((B, T), -2),
         "valid": torch.zeros(B, T, dtype=torch.bool)}
    for j, e in enumerate(examples):
        n = len(e["tokens"]) - 1
        b["states"][j, :n], b["embeds"][j, :n], b["next"][j, :n] = e["states"][:n], e["embeds"][1:], e["states"][1:]
        ids = index[e["top_ids"][1:]]
        b["ids"][j, :n] = ids.clamp_min(0)
        p = e["top_p"][1:] * (ids >= 0)  # mass outside the draft vocabulary cannot be learned: dropped
        b["p"][j, :n] = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
        b["top1"][j, :n] = ids[:, 0]
        b["valid"][j, :n] = True
    return b


def unrolled_mask(T: int) -> torch.Tensor:
    """Attention for the unrolled pass (EAGLE-3's training-time test): entries 0..T-1 are the first drafting step
    over the target's states (causal); entry T + m, the second step at position m + 1, attends to the first
    step's entries at positions 0..m (what the draft's cache holds when it drafts there) and to itself."""
    mask = torch.ones(2 * T - 1, 2 * T - 1, dtype=torch.bool).tril()
    mask[T:, T:] = torch.eye(T - 1, dtype=torch.bool)
    mask[T:, :T] = torch.ones(T - 1, T, dtype=torch.bool).tril()
    return mask


def step_terms(draft: FeatureDraft, pred: torch.Tensor, b: dict, sl: slice) -> tuple[torch.Tensor, ...]:
    """Cross-entropy against the target's top-k, smooth L1 on the state and top-1 agreement, over entries sl."""
    logq = torch.log_softmax(F.linear(pred, draft.lm_head.weight).float(), -1)
    v = b["valid"][:, sl]
    n = v.sum().clamp_min(1)
    ce = (-(b["p"][:, sl] * logq.gather(-1, b["ids"][:, sl])).sum(-1) * v).sum() / n
    reg = (F.smooth_l1_loss(pred, b["next"][:, sl], reduction="none").mean(-1) * v).sum() / n
    agree = ((logq.argmax(-1) == b["top1"][:, sl]) & v).sum() / n
    return ce, reg, agree


def loss_of(draft: FeatureDraft, b: dict, feature_weight: float, unroll: int = 1) -> tuple[torch.Tensor, dict]:
    """The first drafting step's loss; with unroll 2, plus the second step's, which reads the first step's
    predicted state (detached) and the embedding of the token after, as drafting does."""
    B, T, _ = b["states"].shape
    if unroll == 1 or T < 2:
        pred = draft.forward_states(b["states"], b["embeds"])
        ce, reg, agree = step_terms(draft, pred, b, slice(None))
        return ce + feature_weight * reg, {"ce": ce.item(), "reg": reg.item(), "agree": agree.item()}
    with torch.no_grad():
        first = draft.forward_states(b["states"], b["embeds"])
    positions = torch.cat((torch.arange(T), torch.arange(1, T))).expand(B, -1)
    states = torch.cat((b["states"], first[:, :-1]), 1)
    embeds = torch.cat((b["embeds"], b["embeds"][:, 1:]), 1)
    pred = draft.forward_states(states, embeds, positions=positions, attn_mask=unrolled_mask(T))
    ce, reg, agree = step_terms(draft, pred[:, :T], b, slice(None))
    ce2, reg2, agree2 = step_terms(draft, pred[:, T:], b, slice(1, None))
    loss = ce + ce2 + feature_weight * (reg + reg2)
    return loss, {"ce": ce.item(), "reg": reg.item(), "agree": agree.item(), "agree2": agree2.item()}


def optimizer(draft: FeatureDraft, cfg: TrainConfig) -> torch.optim.Optimizer:
    draft.lm_head.weight.requires_grad_(False)  # the target's own rows: frozen, as EAGLE keeps the target's head
    params = [p for p in draft.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))


def lr_scale(final: float, step: int, steps: int) -> float:
    """Cosine from 1 at step 0 to `final` at `steps` and after (1 throughout when steps is 0)."""
    if steps <= 0:
        return 1.0
    return final + (1 - final) * 0.5 * (1 + float(np.cos(np.pi * min(step / steps, 1.0))))


def epoch_order(n: int, epoch: int, batch: int, seed: int) -> list[list[int]]:
    idx = np.random.default_rng(seed + epoch).permutation(n).tolist()
    return [idx[i:i + batch] for i in range(0, n, batch)]


def new_draft(target: Transformer, examples: list[dict], cfg: TrainConfig) -> FeatureDraft:
    counts = [t for e in examples for t in e["top_ids"][:, 0].tolist()]
    ids = frequent_head_ids(target.config, target.tokenizer, min(cfg.head_vocab, target.config.vocab_size - 1), counts)
    return build_feature_draft(target, ids, dim=cfg.dim, ffn_dim=cfg.ffn_dim, seed=cfg.seed)


def draft_from_state(state: dict) -> FeatureDraft:
    mc = state["model_config"]
    draft = FeatureDraft(ModelConfig.from_dict(mc["layer"]), mc["target_dim"])
    draft.load_state_dict(state["model"])
    return draft


def train(target: Transformer, run_dir: Path, cfg: TrainConfig, steps: int | None = None,
          minutes: float | None = None, ckpt_minutes: float = 3.0, progress: bool = True) -> FeatureDraft:
    """Train until `steps` optimizer steps in all (or `minutes` of this call), resuming RUN/ckpt.pt if there."""
    t0 = time.time()
    examples = training_examples(target, run_dir / "data")
    if not examples:
        raise ValueError(f"no training data in {run_dir / 'data'}; run the collect stage first")
    train_set = [e for i, e in enumerate(examples) if not is_validation(i)]
    val_set = [e for i, e in enumerate(examples) if is_validation(i)]
    ckpt = run_dir / "ckpt.pt"
    rng_before = torch.get_rng_state()
    if ckpt.is_file():
        state = load_checkpoint(ckpt)
        cfg = TrainConfig(**state["train_config"])
        draft = draft_from_state(state)
        opt = optimizer(draft, cfg)
        opt.load_state_dict(state["optimizer"])
        step, epoch, order, pos, best = state["step"], state["epoch"], state["order"], state["pos"], state["best"]
        torch.set_rng_state(state["rng"])
    else:
        draft = new_draft(target, examples, cfg)
        opt = optimizer(draft, cfg)
        step, epoch, order, pos, best = 0, 0, None, 0, -1.0
        torch.manual_seed(cfg.seed)
    index = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
    index[draft.head_ids] = torch.arange(len(draft.head_ids))

    def save() -> None:
        save_checkpoint(ckpt, {"model": draft.state_dict(), "optimizer": opt.state_dict(), "step": step,
                               "epoch": epoch, "order": order, "pos": pos, "best": float(best),
                               "rng": torch.get_rng_state(), "train_config": asdict(cfg),
                               "model_config": {"layer": draft.config.to_dict(), "target_dim": draft.target_dim}})

    draft.train()
    bar = tqdm(total=steps, initial=step, desc="train", unit="step", file=sys.stderr, disable=not progress)
    last_ckpt, metrics = time.time(), {}
    while (steps is None or step < steps) and (minutes is None or time.time() - t0 < 60 * minutes):
        if order is None or pos >= len(order):
            order, pos = epoch_order(len(train_set), epoch, cfg.batch, cfg.seed), 0
            epoch += 1
        for g in opt.param_groups:
            g["lr"] = cfg.lr * min(1.0, (step + 1) / cfg.warmup) * lr_scale(cfg.final_lr, step, cfg.decay_steps)
        loss, metrics = loss_of(draft, make_batch([train_set[i] for i in order[pos]], index), cfg.feature_weight,
                                cfg.unroll)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step, pos = step + 1, pos + 1
        bar.update(1)
        bar.set_postfix(ce=f"{metrics['ce']:.3f}", agree=f"{metrics['agree']:.3f}", refresh=False)
        if time.time() - last_ckpt > 60 * ckpt_minutes:
            save()
            last_ckpt = time.time()
    bar.close()
    draft.eval()
    if val_set:
        with torch.no_grad():
            _, val = loss_of(draft, make_batch(val_set, index), cfg.feature_weight, 2)
            best = val["agree"]
            print(f"step {step}: validation top-1 agreement {val['agree']:.3f} (second step {val['agree2']:.3f}), "
                  f"ce {val['ce']:.3f}", file=sys.stderr)
            for kind in sorted({e["name"].split("-")[0] for e in val_set}):  # the target's answers, source code
                part = [e for e in val_set if e["name"].startswith(kind + "-")]
                _, v = loss_of(draft, make_batch(part, index), cfg.feature_weight, 2)
                print(f"  {kind} ({len(part)} sequences): {v['agree']:.3f} (second step {v['agree2']:.3f})",
                      file=sys.stderr)
    save()
    torch.set_rng_state(rng_before)  # the caller's RNG as it was
    return draft


def check_out(out: str, overwrite: bool) -> None:
    """The export folder: new or empty, or replaced whole with --overwrite (checked before any training)."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise ValueError(f"--out {out} exists and is not empty; pass --overwrite to replace it whole")


def export(target: Transformer, run_dir: Path, out: str, overwrite: bool = False) -> None:
    """The trained draft into the folder `out`, written beside it and swapped in, so that no half-written draft
    and no file of the folder it replaces is ever left there."""
    check_out(out, overwrite)
    state = load_checkpoint(run_dir / "ckpt.pt")
    draft = draft_from_state(state)
    measured = state["best"] >= 0  # train() keeps -1 until a validation pass measures it
    meta = {"step": state["step"], "validation_top1_agreement": state["best"] if measured else None,
            **state["train_config"]}
    path = Path(out).resolve()
    tmp, old = (path.parent / f".{path.name}.{what}-{os.getpid()}" for what in ("new", "old"))
    for leftover in (tmp, old):
        shutil.rmtree(leftover, ignore_errors=True)
    draft.save(tmp, target.tokenizer.fingerprint if target.tokenizer else None, meta=meta)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
    agreement = f"{state['best']:.3f}" if measured else "not measured"
    print(f"wrote {out}: step {state['step']}, validation top-1 agreement {agreement}", file=sys.stderr)


def draft_step_time(drafter, prompt: list[int], repeats: int = 30) -> float:
    """Median seconds of one drafting step of a FeatureDrafter after `prompt`: the embedding lookup, one entry
    through the layer, the head and the draw's argmax (random states: the cost does not depend on them)."""
    draft = drafter.model
    cache = draft.new_cache()
    s = cache.new_sequence()
    g = torch.Generator().manual_seed(0)
    states = torch.randn(len(prompt), draft.target_dim, generator=g)
    with torch.inference_mode():
        draft.step(cache, [s], [states], [drafter.embed(prompt)])
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            draft.logits(draft.step(cache, [s], [states[-1:]], [drafter.embed(prompt[-1:])])).argmax(-1).tolist()
            times.append(time.perf_counter() - t)
            cache.truncate(s, len(prompt))
    return statistics.median(times)


def measure(target_dir: str, draft_dir: str, n_prompts: int, new_tokens: int, temperatures=(0.0, 0.7)) -> dict:
    """On the coder bench prompts (never trained on): k="auto" with the draft, greedy and sampled, its acceptance
    by position, tokens per round and k's, the step costs k="auto" measured in the loop and measured alone, and
    tokens/s beside target-only decoding (interleaved per prompt)."""
    from bench_cost import step_time
    from bench_plan import CODER_PROMPTS, merge_stats

    from minispec import load_draft
    from minispec.adaptive import auto_k
    from minispec.sampling import SamplingParams

    target = Transformer.from_pretrained(target_dir)
    drafter = load_draft(draft_dir, target)
    prompts = [target.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in CODER_PROMPTS[:n_prompts]]
    target.speculate(drafter, prompts[0], k="auto", max_new_tokens=16)  # warm up: first touch, the thread tuner
    out = {"target": target_dir, "draft": draft_dir, "new_tokens": new_tokens, "prompts": len(prompts),
           "threads": torch.get_num_threads(), "torch": torch.__version__}
    for temp in temperatures:
        stats, t_spec, t_plain, n_spec, n_plain = [], 0.0, 0.0, 0, 0
        for i, ids in enumerate(tqdm(prompts, desc=f"T={temp}", file=sys.stderr)):
            for which in ((0, 1) if i % 2 == 0 else (1, 0)):
                t = time.perf_counter()
                if which == 0:
                    res = target.speculate(drafter, ids, k="auto", max_new_tokens=new_tokens, temperature=temp, seed=i)
                    t_spec += time.perf_counter() - t
                    n_spec += len(res.tokens)
                    stats.append(res.stats)
                else:
                    n_plain += len(target.generate(ids, max_new_tokens=new_tokens, temperature=temp, seed=i))
                    t_plain += time.perf_counter() - t
        st = merge_stats(stats)
        est = auto_k(target, drafter, SamplingParams(temp), 1)
        out[f"T={temp}"] = {
            "acceptance": st.acceptance_rate, "tokens_per_round": st.mean_accepted,
            "acceptance_by_position": [round(a, 3) for a in st.position_acceptance],
            "drafted_by_position": st.position_drafted, "mean_k": sum(st.k_chosen) / max(len(st.k_chosen), 1),
            "auto_step_ratio": est.draft_step_s / est.verify_cost(0) if est.draft_step_s else None,
            "tok_s": n_spec / t_spec, "target_only_tok_s": n_plain / t_plain,
            "speedup": n_spec / t_spec * t_plain / n_plain}
    d, t = draft_step_time(drafter, prompts[0]), step_time(target, prompts[0], repeats=15)
    out.update(draft_step_ms=d * 1e3, target_step_ms=t * 1e3, step_ratio=d / t)
    return out


POSITIVE, NON_NEGATIVE = float_in(0, math.inf, lo_open=True), float_in(0, math.inf)  # finite numbers
FIELD_TYPES = {"head_vocab": int_at_least(1), "lr": POSITIVE, "warmup": int_at_least(1), "weight_decay": NON_NEGATIVE,
               "feature_weight": NON_NEGATIVE, "batch": int_at_least(1), "seed": int_at_least(0),
               "unroll": int_at_least(1), "decay_steps": int_at_least(0), "final_lr": NON_NEGATIVE}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stage", choices=("collect", "train", "export", "all", "measure"))
    ap.add_argument("--target", required=True, help="the target whose states the draft reads (fp32 is fastest)")
    ap.add_argument("--run", default=RUN)
    ap.add_argument("--out", default=None)
    ap.add_argument("--prompts", default=PROMPTS)
    ap.add_argument("--overwrite", action="store_true", help="export: replace a non-empty --out folder whole")
    ap.add_argument("--gen", type=int_at_least(0), default=32, help="code prompts the target answers")
    ap.add_argument("--src", type=int_at_least(0), default=400, help="pieces of site-packages source, teacher-forced")
    ap.add_argument("--max-new-tokens", type=int_at_least(1), default=128)
    ap.add_argument("--collect-minutes", type=POSITIVE, default=None)
    ap.add_argument("--collect-batch", type=int_at_least(1), default=8, help="sequences a pass while collecting (16 "
                    "generates half again as many positions a second as 8 on 2 cores)")
    ap.add_argument("--steps", type=int_at_least(1), default=None)
    ap.add_argument("--train-minutes", type=POSITIVE, default=None)
    ap.add_argument("--threads", type=int_at_least(1), default=2)
    ap.add_argument("--draft", default=None, help="measure: the draft directory (default --out)")
    ap.add_argument("--n-prompts", type=int_at_least(1), default=8, help="measure: coder bench prompts")
    for name, f in TrainConfig.__dataclass_fields__.items():
        if name not in ("dim", "ffn_dim"):
            ap.add_argument(f"--{name.replace('_', '-')}", type=FIELD_TYPES[name], default=f.default)
    ap.add_argument("--dim", type=int_at_least(1), default=None)
    ap.add_argument("--ffn-dim", type=int_at_least(1), default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    return exit_status(lambda: run_stages(args))


def run_stages(args) -> None:
    """The stages the command line asked for, in order (collect, train, export; or measure)."""
    run_dir = Path(args.run)
    if args.stage in ("export", "all"):  # before any collecting or training, not after it
        if args.out is None:
            raise ValueError("export needs --out DIR")
        check_out(args.out, args.overwrite)
    if args.stage in ("collect", "all"):
        collect(args.target, run_dir / "data", args.prompts, args.gen, args.src, args.max_new_tokens,
                batch=args.collect_batch, minutes=args.collect_minutes)
    if args.stage == "collect":
        return
    if args.stage == "measure":
        report = measure(args.target, args.draft or args.out, args.n_prompts, args.max_new_tokens)
        print(json.dumps(report, indent=2))
        return
    target = Transformer.from_pretrained(args.target, dtype=torch.float32)
    if args.stage in ("train", "all"):
        cfg = TrainConfig(**{k: getattr(args, k) for k in TrainConfig.__dataclass_fields__})
        train(target, run_dir, cfg, args.steps, args.train_minutes)
    if args.stage in ("export", "all"):
        export(target, run_dir, args.out, args.overwrite)


if __name__ == "__main__":
    sys.exit(main())
