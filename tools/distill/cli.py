"""The command line of tools/distill_draft.py: one sub-command per stage, and `all` for the whole pipeline.

Every user error (a bad argument, a missing or unusable file) ends with one
line `error: ...` on stderr and exit status 1; Ctrl-C with status 130.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
from pathlib import Path

import torch
from distill_prompts import load_prompts

from minispec import ModelConfig, Transformer
from minispec.cli import device_argument
from minispec.tokenizer import load_tokenizer

from .checkpoint import CKPT_NAME, draft_from_checkpoint, load_checkpoint
from .common import DATA, DRAFT_OUT, DTYPES, LABELS, PROMPTS, RUN, TARGET, log, set_threads
from .draft import export_draft
from .generation import generate_stage
from .measure import measure_stage
from .training import OPTIM_FIELDS, StopRequest, TrainConfig, train_stage

PATHS = {"target": (TARGET, "the target checkpoint"), "data": (DATA, "target text shards (one directory per target)"),
         "labels": (LABELS, "the shards' soft labels (recomputed when missing)"), "run": (RUN, "training checkpoints"),
         "prompts": (PROMPTS, "prompts.jsonl (tools/distill_prompts.py)")}


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def signal_handlers(handler, *signums: int):
    """Install `handler` for the signals while the block runs, then put the previous handlers back."""
    old = {s: signal.signal(s, handler) for s in signums}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def add_paths(p: argparse.ArgumentParser, *names: str) -> None:
    for name in names:
        default, help_ = PATHS[name]
        p.add_argument("--" + name, default=default, help=f"{help_} (default {default})")


def add_machine(p: argparse.ArgumentParser, dtype_help: str, device: bool = True) -> None:
    """--threads, --device and --target-dtype."""
    p.add_argument("--threads", type=int, default=2)
    if device:
        p.add_argument("--device", type=device_argument, default=None, help="e.g. cuda (default: cpu)")
    p.add_argument("--target-dtype", choices=DTYPES, default="float32", help=dtype_help)


def cmd_generate(args) -> None:
    set_threads(args.threads)
    torch.manual_seed(0)
    target = Transformer.from_pretrained(args.target, device=args.device, dtype=DTYPES[args.target_dtype])
    with signal_handlers(_interrupt, signal.SIGTERM):  # `kill` flushes the finished sequences like Ctrl-C does
        generate_stage(target, load_prompts(args.prompts), args.data, args.labels, batch=args.batch,
                       max_new_tokens=args.max_new_tokens, sample_every=args.sample_every,
                       temperature=args.temperature, samples=args.samples, flush_every=args.flush_every,
                       minutes=args.minutes, max_items=args.max_items, refill=args.refill)


def cmd_train(args) -> None:
    set_threads(args.threads)
    given = {f: getattr(args, f) for f in TrainConfig.__dataclass_fields__ if getattr(args, f) is not None}
    overrides = {f: v for f, v in given.items() if f in OPTIM_FIELDS}  # applied when resuming a run
    stop = StopRequest()
    with signal_handlers(stop, signal.SIGTERM, signal.SIGINT):
        train_stage(args.run, args.data, args.labels, args.target, TrainConfig(**given), minutes=args.minutes,
                    max_steps=args.max_steps, ckpt_minutes=args.ckpt_minutes, export_to=args.export or None,
                    export_minutes=args.export_minutes, eval_every=args.eval_every, min_growth=args.min_growth,
                    overrides=overrides, device=args.device, target_dtype=DTYPES[args.target_dtype],
                    init_from=args.init_from, autocast=args.bf16_autocast, stop=stop)


def cmd_export(args) -> None:
    path = Path(args.run) / CKPT_NAME
    state = load_checkpoint(path)
    export_draft(draft_from_checkpoint(state, path), load_tokenizer(args.target), args.out,
                 {"step": state["step"], "epoch": state["epoch"]})
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
    run(["generate", *common, *data, "--prompts", args.prompts, *minutes(args.gen_minutes)])
    target_dim = ModelConfig.load(str(Path(args.target) / "config.json")).dim
    arch = ["--dim", str(args.dim or min(TrainConfig.dim, target_dim))]  # the embedding is projected: dim <= target's
    arch += ["--n-layers", str(args.n_layers)] if args.n_layers else []
    arch += ["--head-vocab", str(args.head_vocab)] if args.head_vocab else []
    run(["train", *common, *data, "--run", args.run, "--export", args.out, *minutes(args.train_minutes), *arch])
    if args.measure:
        run(["measure", "--target", args.target, "--draft", args.out, "--prompts", args.prompts,
             "--threads", str(args.threads)])


def add_all(sub) -> None:
    a = sub.add_parser("all", help="the whole pipeline: generate, train, export to --out (and --measure); "
                                   "also what runs when the first argument is an option")
    add_paths(a, "target", "data", "labels", "run", "prompts")
    a.add_argument("--out", default=DRAFT_OUT, help="where the best draft goes")
    a.add_argument("--gen-minutes", type=float, default=None,
                   help="stop generating after this long (default: all prompts)")
    a.add_argument("--train-minutes", type=float, default=None,
                   help="stop training after this long (default: never)")
    a.add_argument("--dim", type=int, default=None,
                   help=f"draft width for a new run (default {TrainConfig.dim}, at most the target's)")
    a.add_argument("--n-layers", type=int, default=None,
                   help=f"draft depth for a new run (default {TrainConfig.n_layers})")
    a.add_argument("--head-vocab", type=int, default=None,
                   help=f"draft head size for a new run (default {TrainConfig.head_vocab})")
    a.add_argument("--measure", action="store_true", help="measure acceptance on held-out prompts at the end")
    add_machine(a, "the target's dtype while generating text and soft labels")
    a.set_defaults(func=cmd_all)


def add_generate(sub) -> None:
    g = sub.add_parser("generate", help="target responses to the prompts -> data/distill shards")
    add_paths(g, "target", "data", "labels", "prompts")
    g.add_argument("--refill", type=int, default=8, help="admit new prompts when this many batch slots are free")
    g.add_argument("--batch", type=int, default=64)
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--sample-every", type=int, default=3, help="also sample every n-th prompt at --temperature")
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--samples", type=int, default=1, help="sampled answers per sampled prompt (more target text)")
    g.add_argument("--flush-every", type=int, default=128, help="write a shard every n finished sequences")
    g.add_argument("--minutes", type=float, default=None, help="stop after this many minutes")
    g.add_argument("--max-items", type=int, default=None)
    add_machine(g, "the target's dtype while generating")
    g.set_defaults(func=cmd_generate)


def add_train(sub) -> None:
    t = sub.add_parser("train", help="distil the draft (resumes from RUN/ckpt.pt)")
    add_paths(t, "run", "target", "data", "labels")
    t.add_argument("--minutes", type=float, default=None)
    t.add_argument("--max-steps", type=int, default=None)
    t.add_argument("--ckpt-minutes", type=float, default=5.0)
    t.add_argument("--export", default=DRAFT_OUT, help="write the best draft here ('' = never)")
    t.add_argument("--export-minutes", type=float, default=0.0, help="at least this long between exports")
    t.add_argument("--eval-every", type=int, default=200)
    t.add_argument("--min-growth", type=float, default=0.0,
                   help="start a new epoch only when the data has grown by this fraction "
                        "(when a generator runs alongside)")
    add_machine(t, "the target's dtype when soft labels must be recomputed")
    t.add_argument("--bf16-autocast", action="store_true",
                   help="run the draft's matrix products in bfloat16 (weights and optimizer stay float32); "
                        "faster where the CPU or GPU has native bf16 matrix products")
    t.add_argument("--init-from", default=None,
                   help="start a new run from this exported draft (its architecture and head) instead of from the "
                        "target's embedding; ignored when the run directory already has a checkpoint")
    for f in TrainConfig.__dataclass_fields__.values():
        # architecture: for a new run only; optimisation (OPTIM_FIELDS): also changes a resumed run when given
        t.add_argument("--" + f.name.replace("_", "-"), type=float if isinstance(f.default, float) else int,
                       default=None, help=f"default {f.default}")
    t.set_defaults(func=cmd_train)


def add_export(sub) -> None:
    e = sub.add_parser("export", help="RUN/ckpt.pt -> a bf16 draft checkpoint with the target's tokenizer")
    add_paths(e, "run", "target")
    e.add_argument("--out", default=DRAFT_OUT)
    e.set_defaults(func=cmd_export)


def add_measure(sub) -> None:
    m = sub.add_parser("measure", help="acceptance on held-out prompts and the step-cost ratio")
    add_paths(m, "target")
    m.add_argument("--draft", default=DRAFT_OUT)
    add_paths(m, "prompts")
    m.add_argument("--n-prompts", type=int, default=32)
    m.add_argument("--k", type=int, default=4)
    m.add_argument("--max-new-tokens", type=int, default=128)
    m.add_argument("--no-speculate", action="store_true")
    m.add_argument("--out", default=None, help="also write the figures to this JSON file")
    m.add_argument("--threads", type=int, default=2)
    m.set_defaults(func=cmd_measure)


def parser(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description, epilog="Every stage is resumable: kill it at any moment "
                                 "and run the same command again.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for add in (add_all, add_generate, add_train, add_export, add_measure):
        add(sub)
    return ap


def run(argv: list[str]) -> None:
    """Parse argv and run its stage; errors propagate (main turns them into one line)."""
    if argv and argv[0].startswith("--") and argv[0] != "--help":
        argv = ["all", *argv]  # python tools/distill_draft.py --target DIR --out DIR: the whole pipeline
    description = "Distil a small draft model for speculative decoding from a target's own generations."
    args = parser(description).parse_args(argv)
    args.func(args)


def exit_status(job) -> int:
    """job() run as a command: 0 on success, 1 with `error: ...` on a user error, 130 on Ctrl-C."""
    try:
        job()
    except (ValueError, OSError) as e:  # the project's errors (CheckpointError, DataError) are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


def main(argv=None) -> int:
    """The entry point: 0 on success, 1 with `error: ...` on a user error, 130 on Ctrl-C."""
    return exit_status(lambda: run(sys.argv[1:] if argv is None else list(argv)))
