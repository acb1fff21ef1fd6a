"""Command line: python -m minispec COMMAND ...

    python -m minispec generate --target weights/smollm2-135m-instruct --prompt "Once upon a time"
    python -m minispec generate --target weights/smollm2-135m-instruct --draft weights/smollm2-135m-draft \
        --chat --prompt "What is speculative decoding?" --temperature 0.7 --seed 0

Each subcommand is an entry in COMMANDS: a function adding its arguments to an argparse
parser and a function running it, returning the exit status. Adding one is a few lines.
Bad arguments exit with status 2 (argparse's convention); failures while running (a
checkpoint that does not load, a device that is not there, ...) print one line
`error: ...` and exit with status 1. A traceback means a bug in minispec.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from . import draft_loader
from .config import DTYPES
from .drafters import PROMPT_LOOKUP
from .equivalence import DEFAULTS, MIN_SAMPLES, ORDERS, EquivalenceInputError, audit, audit_samples, plot_report
from .equivalence.drawing import SERVER_MAX_SEED
from .equivalence.http import REQUEST_S, ServerError, base_url
from .equivalence.llama_server import CONCURRENCY as LLAMA_CPP_CONCURRENCY
from .equivalence.samples import check_output_path, open_regular
from .errors import MAX_SEED, GenerationError, InputError, one_line, resolve_device
from .model import Transformer
from .speculative import AUTO_FIXED, SAMPLERS
from .threads import fixed_threads
from .tree import DynamicTree, parse_tree, tree_text


class CLIError(RuntimeError):
    """A failure while running a command: printed as `error: ...`, exit status 1."""


class UsageError(ValueError):
    """Bad command-line input found after argument parsing (a prompt file, a prompt that encodes to nothing):
    exit status 2."""


# ---- argument types: a bad value is an argparse error (exit status 2) naming the option (the tools use them too)

def int_at_least(lo: int):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{v} is less than {lo}")
        return v
    return parse


def float_in(lo: float, hi: float, lo_open: bool = False, hi_open: bool = False):
    """A finite number in the interval (inf and nan are refused even where hi is inf: no setting takes them)."""
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"{s!r} is not a finite number")
        if not (lo < v if lo_open else lo <= v) or not (v < hi if hi_open else v <= hi):
            interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
            raise argparse.ArgumentTypeError(f"{v} is outside {interval}")
        return v
    return parse


def _checkpoint_dir(s: str) -> str:
    p = Path(s)
    if not (p / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{s} is not a minispec checkpoint directory (no config.json there); "
                                         "make one with tools/convert_gguf.py or `make weights`")
    return s


def k_argument(s: str) -> int | str:
    return "auto" if s == "auto" else int_at_least(1)(s)


def generate_k_argument(s: str) -> int | str:
    """generate's --k: also auto-fixed, k="auto" with fixed step costs (reproducible from the seed)."""
    return AUTO_FIXED if s == AUTO_FIXED else k_argument(s)


def tree_argument(s: str) -> tuple[int, ...] | DynamicTree | str:
    """--tree: "auto", the children per depth as comma-separated integers ("2,2,2"), or a dynamic tree WIDTHxDEPTH
    ("4x4"), checked as speculate checks them."""
    try:
        return parse_tree(s)
    except GenerationError as e:
        raise argparse.ArgumentTypeError(one_line(e)) from None


def _draft(s: str) -> str:
    return s if s == PROMPT_LOOKUP else _checkpoint_dir(s)


def _int_in(lo: int, hi: int):
    def parse(s: str) -> int:
        v = int_at_least(lo)(s)
        if v > hi:
            raise argparse.ArgumentTypeError(f"{v} is more than {hi}")
        return v
    return parse


def device_argument(s: str) -> str:
    """A device torch can use here: "potato" or "cuda" on a machine without CUDA are argparse errors."""
    try:
        resolve_device(s)
    except InputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return s


def _device(s: str | None) -> str:
    if s is not None:
        return s
    return "cuda" if torch.cuda.is_available() else "cpu"


# ---- generate

def add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, type=_checkpoint_dir, metavar="DIR", help="the target checkpoint")
    p.add_argument("--draft", type=_draft, metavar="DIR|prompt-lookup",
                   help="speculative decoding with this draft checkpoint, or with prompt lookup (n-gram drafts)")
    p.add_argument("--k", type=generate_k_argument, default=None,
                   help="draft tokens proposed per round, or 'auto' (the default): chosen each round from the "
                        "measured acceptance rate and step costs, plain decoding when speculation would not pay; "
                        f"or '{AUTO_FIXED}': chosen from the acceptance rate with fixed step costs (the configs' "
                        "sizes), so that --seed fixes the tokens")
    p.add_argument("--tree", type=tree_argument, metavar="B1,...,BD|WxD|auto",
                   help="instead of --k, a token tree per round: every node at depth i-1 gets B_i children (e.g. "
                        "2,2,2: 14 drafts scored in one pass), a model draft only; WxD (e.g. 4x4): D depths of at "
                        "most W nodes placed by the draft's own probabilities; 'auto' picks a chain or a tree "
                        "each round from the measured acceptance and step costs")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message with the checkpoint's chat template")
    p.add_argument("--max-new-tokens", type=int_at_least(0), default=64, help="default 64")
    p.add_argument("--temperature", type=float_in(0.0, float("inf")), default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int_at_least(1), default=None, help="sample from the k most likely tokens")
    p.add_argument("--top-p", type=float_in(0.0, 1.0, lo_open=True), default=None, help="nucleus sampling mass")
    p.add_argument("--seed", type=_int_in(0, MAX_SEED), default=0,
                   help="the same seed gives the same tokens, except with --draft and --k auto: k then follows "
                        "measured timings, so the tokens can differ run to run (their distribution is exact "
                        f"either way); --k {AUTO_FIXED} or a number keeps them fixed (default 0)")
    p.add_argument("--device", type=device_argument, default=None,
                   help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="compute dtype (default: as stored)")
    p.add_argument("--draft-dtype", choices=(*DTYPES, "int4"), default=None,
                   help="the draft's compute dtype, or int4 products on a CPU (default: as its config.json says, "
                        "else as stored, except that a bfloat16 draft computes in the target's dtype on a CPU, where "
                        "bf16 has no fast kernels); the output stays the target's")


def load_target(path: str, device, dtype: str | None = None) -> Transformer:
    """The target in `dtype` (a DTYPES name), or as stored."""
    return Transformer.from_pretrained(path, device=device, dtype=DTYPES[dtype] if dtype else None)


def load_draft(path: str, device, target: Transformer, dtype: str | None = None):
    """minispec.load_draft (any draft directory the project writes, checked against the target), in the order of
    the command line's arguments."""
    return draft_loader.load_draft(path, target, dtype, device)


def run_generate(args: argparse.Namespace) -> int:
    """Stream the continuation to stdout; the tokens/s (and speculation) summary goes to stderr."""
    if args.tree is not None and args.k is not None:
        raise UsageError("give --k (a chain of drafts) or --tree (a tree of them), not both")
    if args.tree is not None and args.draft in (None, PROMPT_LOOKUP):
        raise UsageError("--tree needs a model draft (--draft DIR): prompt lookup and plain decoding draft no tree")
    if args.tree is None and args.k is None:
        args.k = "auto"
    device = _device(args.device)
    target = load_target(args.target, device, args.dtype)
    tok, ids = _encode_prompt(args, target)
    draft = None
    if args.draft == PROMPT_LOOKUP:
        draft = PROMPT_LOOKUP
    elif args.draft is not None:
        draft = load_draft(args.draft, device, target, args.draft_dtype)

    stream = tok.decoder_stream(skip_special_tokens=True)

    def on_tokens(i: int, tokens: list[int]) -> None:
        sys.stdout.write(stream.push(tokens))
        sys.stdout.flush()

    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, seed=args.seed, on_tokens=on_tokens)
    start = time.perf_counter()
    if draft is None:
        new, stats = target.generate(ids, **sampling), None
    else:
        how = {"k": args.k} if args.tree is None else {"tree": args.tree}
        res = target.speculate(draft, ids, stop_tokens=None, **how, **sampling)
        new, stats = res.tokens, res.stats
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    sys.stdout.write(stream.flush() + "\n")
    sys.stdout.flush()
    summary = (f"{len(new)} tokens in {elapsed:.2f} s: {len(new) / max(elapsed, 1e-9):.1f} tokens/s "
               f"(prompt {len(ids)} tokens, prefill included)")
    print(summary + ("" if stats is None else _speculation_summary(args, stats)), file=sys.stderr)
    return 0


def _encode_prompt(args: argparse.Namespace, target: Transformer) -> tuple:
    """The target's tokenizer and the prompt's token ids (--chat: as the user's turn of its chat template)."""
    tok = target.tokenizer
    if tok is None:
        raise CLIError(f"{args.target} has no tokenizer (tokenizer.json or tokenizer.model); generate needs one")
    if args.chat:
        ids = tok.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        ids = tok.encode(args.prompt)
    if not ids:
        raise CLIError("the prompt encodes to no tokens and this tokenizer adds no bos; give a non-empty --prompt")
    return tok, ids


def _speculation_summary(args: argparse.Namespace, stats) -> str:
    """generate's summary of the speculation: k (or the tree), rounds, acceptance, tokens per round."""
    mean_k = sum(stats.k_chosen) / max(len(stats.k_chosen), 1)
    k = args.k if isinstance(args.k, int) else f"{args.k} (mean {mean_k:.1f})"
    if args.tree is not None:
        shapes = [sh for sh in stats.tree_chosen if sh]
        most = max(set(shapes), key=shapes.count, default=None)
        k = f"tree={tree_text(args.tree)}" + (f" (most chosen {tree_text(most) if most else 'plain'})"
                                               if args.tree == "auto" else "")
    else:
        k = f"k={k}"
    return (f"; speculation {k}: {stats.rounds} rounds, acceptance rate {stats.acceptance_rate:.3f}, "
            f"{stats.mean_accepted:.2f} tokens per round")


# ---- the command table and entry point

def _jsonl_out(s: str) -> str:
    """An output file whose folder exists and that is a regular file if it exists (checked before any sampling,
    so a long run cannot end unwritable, blocked on a FIFO or writing over a device)."""
    parent = Path(s).resolve().parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"folder {parent} does not exist")
    try:
        check_output_path(s, "the file")
    except InputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return s


def _samples_file(s: str) -> str:
    """A samples file that is a regular file (a FIFO would block the read, a device such as /dev/zero never
    ends), checked before the target loads; read_samples checks it again as it reads."""
    try:
        open_regular(s, "samples file").close()
    except InputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return s


def _url(s: str) -> str:
    """An http(s) address with a usable port and host, checked before the target loads; its path is kept (an
    OpenAI-compatible BASE ends in /v1)."""
    try:
        root = base_url(s)
        path = s.strip().split("://", 1)[-1].partition("/")[2].rstrip("/")
        return root + (f"/{path}" if path else "")
    except ServerError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_equivalence_args(p: argparse.ArgumentParser) -> None:
    """The `equivalence` subcommand: every value is checked here, so bad input exits with 2 before a model loads."""
    _add_engine_args(p)
    _add_sample_args(p, DEFAULTS)
    _add_test_args(p, DEFAULTS)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """equivalence's models and engines: what draws the samples, and the servers' options."""
    p.add_argument("--target", type=_checkpoint_dir, metavar="DIR",
                   help="the target checkpoint directory (minispec's model scores every sample); without it a "
                        "server engine is audited by the two-sample test against reference samples drawn with "
                        "speculation off (--reference-url, or a plain llama-server started beside --server-model)")
    p.add_argument("--draft", type=_draft, metavar="DIR|prompt-lookup",
                   help="the draft checkpoint directory, or prompt-lookup (n-gram drafts from the context); needed by "
                        "--engine minispec and transformers-assisted, not with --samples-file")
    p.add_argument("--engine", choices=audit.ENGINES, default="minispec",
                   help="what draws the samples: minispec's speculate (default), transformers' plain sampling, "
                        "transformers' assisted generation (the pair exported by minispec.hf_export, or "
                        "--hf-target/--hf-draft), llama.cpp's llama-server (--server-model, or --url), any "
                        "OpenAI-compatible completions endpoint (openai: --url BASE ending in /v1) or SGLang's "
                        "native /generate (sglang: --url ROOT)")
    p.add_argument("--server-model", metavar="FILE.gguf",
                   help="--engine llama.cpp: the GGUF llama-server serves as the target (started on a free local "
                        "port and stopped afterwards); it must be the --target model (an F32 GGUF of it)")
    p.add_argument("--server-draft", metavar="FILE.gguf",
                   help="--engine llama.cpp: the draft model llama-server speculates with (at most --k tokens)")
    p.add_argument("--url", type=_url, metavar="URL",
                   help="--engine llama.cpp: a llama-server already running there (nothing started or stopped)")
    p.add_argument("--model", metavar="NAME",
                   help="--engine openai: the model to ask for (default: the first of BASE/models)")
    p.add_argument("--reference-url", type=_url, metavar="URL",
                   help="without --target: a deployment of the same model without speculation, whose samples are "
                        "the two-sample audit's reference (the same engine kind as --url)")
    p.add_argument("--request-timeout", type=float_in(0.0, float("inf"), lo_open=True), metavar="SECONDS",
                   default=REQUEST_S, help="server engines: the deadline of one whole answer, a trickling one "
                                           f"included (default {REQUEST_S:g})")
    p.add_argument("--concurrency", type=int_at_least(1), metavar="N",
                   help="server engines: requests kept in flight, which the server batches (default "
                        f"{LLAMA_CPP_CONCURRENCY} for a llama-server, 1 otherwise)")
    p.add_argument("--mixed-seeds", action="store_true",
                   help="server engines: every other request unseeded, as a batch mixing seeded and unseeded "
                        "requests")
    p.add_argument("--prompt-ids", action="append", metavar="IDS",
                   help="a prompt as comma-separated token ids (repeatable); the prompts of a run without --target")
    p.add_argument("--server-threads", type=int_at_least(1), metavar="N",
                   help="--engine llama.cpp: the CPU threads of the server it starts (default: llama.cpp's own)")
    p.add_argument("--no-model-check", action="store_true",
                   help="--engine llama.cpp: skip the check that the server runs the --target model")
    p.add_argument("--hf-target", metavar="DIR", help="the target as a Hugging Face directory for the transformers "
                                                      "engines (default: --target exported into a temporary one)")
    p.add_argument("--hf-draft", metavar="DIR", help="the assistant as a Hugging Face directory for "
                                                     "transformers-assisted (default: --draft exported)")


def _add_sample_args(p: argparse.ArgumentParser, d: dict) -> None:
    """equivalence's samples: a file of them, or the prompts and the sampling settings they are drawn with."""
    p.add_argument("--samples-file", type=_samples_file, metavar="FILE.jsonl",
                   help="test samples drawn by any engine (first line: the settings; then one "
                        '{"prompt": [ids], "tokens": [ids]} per line; see docs/equivalence.md)')
    p.add_argument("--save-samples", type=_jsonl_out, metavar="FILE.jsonl",
                   help="write the samples tested, in the --samples-file format (once the verdict is complete)")
    p.add_argument("--prompt", metavar="TEXT", help="a prompt (text)")
    p.add_argument("--prompts", metavar="FILE", help="a file of prompts, one per line (with --prompt: both)")
    p.add_argument("--samples", type=int_at_least(MIN_SAMPLES), metavar="N",
                   help=f"samples per prompt, >= {MIN_SAMPLES} (default {d['samples']})")
    p.add_argument("--tokens", type=int_at_least(1), metavar="T",
                   help=f"new tokens per sample (default {d['tokens']})")
    p.add_argument("--temperature", type=float_in(0.0, float("inf")), metavar="X",
                   help=f"default {d['temperature']}; 0 checks equality with target greedy instead")
    p.add_argument("--top-k", type=int_at_least(0), metavar="K",
                   help=f"sample from the k most likely tokens; 0 = off (default {d['top_k']})")
    p.add_argument("--top-p", type=float_in(0.0, 1.0, lo_open=True), metavar="P", help="nucleus sampling mass")
    p.add_argument("--k", type=k_argument, metavar="K",
                   help=f"draft tokens per round, or 'auto' (default {d['k']}); for transformers-assisted, the "
                        "assistant's num_assistant_tokens ('auto': transformers' own schedule)")
    p.add_argument("--tree", type=tree_argument, metavar="B1,...,BD|WxD|auto",
                   help="--engine minispec: instead of --k, a token tree per round (children per depth, e.g. 2,2,2; "
                        "WxD, e.g. 4x4: placed by the draft), or 'auto' (a chain or a tree chosen each round from "
                        "measured costs)")
    p.add_argument("--seed", type=int_at_least(0), metavar="S", default=0,
                   help="sample g uses seed + g (default 0); each engine takes seeds up to its own bound (a server "
                        f"engine {SERVER_MAX_SEED}, minispec and transformers {MAX_SEED})")
    p.add_argument("--sampler", choices=list(SAMPLERS), metavar="NAME",
                   help=f"{' | '.join(SAMPLERS)}: the broken ones are negative controls the test must reject")


def _add_test_args(p: argparse.ArgumentParser, d: dict) -> None:
    """equivalence's test and report: level, PIT order, bins, batches, power, output, devices and dtypes."""
    p.add_argument("--alpha", type=float_in(0.0, 1.0, lo_open=True, hi_open=True), metavar="A", default=d["alpha"],
                   help=f"significance level of the verdict, in (0, 1) (default {d['alpha']})")
    p.add_argument("--order", choices=("id", "prob", "both"), default="both",
                   help="token order of the PIT's CDF: token ids, descending probability, or both (default)")
    p.add_argument("--bins", type=int_at_least(2), metavar="B", default=d["bins"],
                   help="chi-square histogram bins (default 20)")
    p.add_argument("--batch-size", type=int_at_least(1), metavar="B", default=d["batch_size"],
                   help=f"samples per batched sampling call and per early-stop look (default {d['batch_size']})")
    p.add_argument("--power-runs", type=int_at_least(0), metavar="R", default=d["power_runs"],
                   help=f"simulated runs per bias size for the power figure; 0 = none (default {d['power_runs']})")
    p.add_argument("--no-reference", action="store_true", help="skip the target-only calibration run (halves the time)")
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    p.add_argument("--plot", metavar="OUT.png", help="write the u histograms per position (needs matplotlib)")
    p.add_argument("--device", type=device_argument, default=None, metavar="DEV",
                   help="cpu, cuda, ... (default: cuda when available)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="the target's compute dtype, for sampling and scoring (default: as stored)")
    p.add_argument("--draft-dtype", choices=(*DTYPES, "int4"), default=None,
                   help="the draft's compute dtype, or int4 products on a CPU (default: as generate's --draft-dtype)")


def _prompt_ids(args) -> list[list[int]]:
    """--prompt-ids "1,2,3" (repeatable) -> the prompts as ids."""
    if not args.prompt_ids:
        raise UsageError("give the prompts as token ids: --prompt-ids 1,2,3 (without --target there is no tokenizer)")
    out = []
    for text in args.prompt_ids:
        try:
            ids = [int(t) for t in text.replace(" ", "").split(",") if t]
        except ValueError:
            raise UsageError(f"--prompt-ids {text!r} is not a comma-separated list of token ids") from None
        if not ids or min(ids) < 0:
            raise UsageError(f"--prompt-ids {text!r}: give one or more token ids >= 0")
        out.append(ids)
    return out


def _read_prompts(args) -> list[str]:
    texts = [] if args.prompt is None else [args.prompt]
    if args.prompts is not None:
        try:
            lines = Path(args.prompts).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read --prompts {args.prompts}: {getattr(e, 'strerror', None) or e}") from None
        lines = [line for line in lines if line.strip()]
        if not lines:
            raise UsageError(f"--prompts {args.prompts} holds no prompts (one per line)")
        texts += lines
    if not texts:
        raise UsageError("give a prompt: --prompt TEXT or --prompts FILE")
    return texts


def _check_plot(args) -> None:
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install matplotlib (an optional extra)") from None


def _encode_prompts(args, texts: list[str], target) -> list[list[int]]:
    tok = target.tokenizer
    if tok is None:
        raise UsageError(f"{args.target} has no tokenizer (tokenizer.json or tokenizer.model); the prompts are text")
    prompts = []
    for i, text in enumerate(texts):
        ids = tok.encode(text)
        if not ids:
            raise UsageError(f"prompt {i} ({text!r}) encodes to no tokens and this tokenizer adds no bos; "
                             "give a non-empty prompt")
        prompts.append(ids)
    return prompts


def run_equivalence_cli(args: argparse.Namespace) -> int:
    """Run the audit (minispec.equivalence.audit). Exit status: 0 passed, 1 failed (or uncalibrated), 2 bad input.
    Nothing is written (--save-samples, --plot) until the verdict is complete."""
    audit.check_options(args)
    _check_plot(args)
    if args.target is None:  # the two-sample audit of a server: no model at all
        report = audit.two_sample(args, _prompt_ids(args))
        print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
        return 0 if report.passed else 1
    texts = None if args.samples_file is not None or args.prompt_ids else _read_prompts(args)  # before any model
    device = _device(args.device)
    target = load_target(args.target, device, args.dtype)
    label = lambda path, dtype: path if dtype is None else f"{path} ({dtype})"  # noqa: E731
    orders = ORDERS if args.order == "both" else (args.order,)
    test = dict(seed=args.seed, alpha=args.alpha, bins=args.bins, orders=orders,
                reference=not args.no_reference, batch_size=args.batch_size, progress=True, power_runs=args.power_runs,
                names={"target": label(args.target, args.dtype), "draft": label(args.draft, args.draft_dtype)})
    if args.samples_file is not None:
        report = audit_samples(target, args.samples_file, **test)
    else:
        prompts = _prompt_ids(args) if args.prompt_ids else _encode_prompts(args, texts, target)
        report = audit.run(args, target, prompts, test, device)
    _write_outputs(args, report)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return 0 if report.passed and report.calibrated is not False else 1


def _write_outputs(args, report) -> None:
    """--plot and --save-samples, written once the verdict is complete."""
    if args.plot is not None:
        if report.mode == "pit":
            plot_report(report, args.plot)
            report.notes.append(f"u histograms written to {args.plot}")
        else:
            report.notes.append("--plot ignored: a greedy run has no u's to plot")
    if args.save_samples is not None:
        report.samples.write(args.save_samples)
        report.notes.append(f"the {len(report.samples.tokens)} samples tested written to {args.save_samples}")


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments for tools/bench.py (see its --help)")


def run_bench(args) -> int:
    """tools/bench.py lives beside the package in a source checkout; it is not part of the installed library.

    It runs as its own process, as `python tools/bench.py ...` would (its folder on sys.path for its modules),
    importing this same minispec; its output and exit status are the command's."""
    import os
    import subprocess
    root = Path(__file__).resolve().parent.parent
    script = root / "tools" / "bench.py"
    if not script.is_file():
        raise CLIError(f"{script} not found: the benchmark runs from a source checkout of minispec")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, str(script), *args.bench_args], env=env).returncode


# name -> (help, add_arguments(parser), run(args) -> exit status)
COMMANDS = {
    "generate": ("generate text from a prompt, optionally with a speculative draft", add_generate_args, run_generate),
    "equivalence": ("test that a draft/target pair's speculative samples follow the target's distribution",
                    add_equivalence_args, run_equivalence_cli),
    "bench": ("speed benchmarks side by side with transformers (tools/bench.py)", add_bench_args, run_bench),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minispec",
                                     description="minispec: a small Llama-family transformer with exact "
                                                 "speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, add_args, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_args(p)
        p.set_defaults(run=run)
    return parser


def _out_of_memory() -> tuple[type[BaseException], ...]:
    """The out-of-memory errors (Python's and torch's allocators')."""
    return MemoryError, torch.OutOfMemoryError


def _check_environment() -> None:
    """The settings minispec reads from the environment, checked before any model loads (a UsageError)."""
    try:
        fixed_threads()
    except ValueError as e:
        raise UsageError(str(e)) from None


LIST_OPTIONS = ("--tree", "--prompt-ids")  # options whose value is a comma-separated list of integers


def _attach_list_values(argv: list[str]) -> list[str]:
    """`--tree -1,2` as `--tree=-1,2`: argparse takes a value that starts with "-" and is no plain number for an
    option, so "-1,2" would read as a missing value instead of reaching the option's own check."""
    if not argv or argv[0] not in ("generate", "equivalence"):  # bench hands its arguments on untouched
        return argv
    out: list[str] = []
    for a in argv:
        if out and out[-1] in LIST_OPTIONS and len(a) > 1 and a[0] == "-" and a[1].isdigit():
            out[-1] = f"{out[-1]}={a}"
        else:
            out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(_attach_list_values(sys.argv[1:] if argv is None else list(argv)))
    try:
        _check_environment()
        return args.run(args)
    except KeyboardInterrupt:  # one line, whatever was running (a server started for the run is stopped)
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (UsageError, EquivalenceInputError) as e:  # bad input: argparse's status
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    except (CLIError, ValueError, OSError) as e:  # checkpoint, tokenizer and argument-value errors say what to do
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 1
    except _out_of_memory() as e:
        print(f"error: out of memory ({one_line(e)}); try --dtype bfloat16, a smaller --max-new-tokens, "
              "or another --device", file=sys.stderr)
        return 1
