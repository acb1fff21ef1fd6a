"""Benchmarks, measured side by side in one run (the machines are shared and noisy: compare ratios, quote medians).

    python tools/bench.py core     # minispec greedy generate vs transformers' LlamaForCausalLM.generate,
                                   # random weights of SmolLM2-135M's shape, fp32, 2 threads
    python tools/bench.py spec     # SmolLM2-135M-Instruct and its draft: minispec target-only, speculate
                                   # (greedy and T=0.7, k = 1..8 and auto, prompt lookup), transformers generate
                                   # and assisted generation with the same draft, batch sizes 1/4/16;
                                   # a markdown table, a PNG plot, predicted vs measured tokens per round,
                                   # peak memory of target + draft beside target alone
    python tools/bench.py spec --pair coder --phases quantized   # the 1.5B as shipped (Q4_K_M kept) beside
                                   # llama.cpp plain and speculative on the same files; pass costs by rows; peak RSS
    python tools/bench.py distance --pair coder --target weights/qwen2.5-coder-1.5b-instruct-q4km   # its KL
    python tools/bench.py greedy --pair coder   # not speed: greedy speculate equals generate on every bench prompt
    python tools/bench.py drafts --pair coder --ks 4 [--draft SUBSET_DIR]   # the pair's small model in fp32
                                   # fp16 and int4 (and another draft, e.g. with a subset head): acceptance, draft
                                   # step cost, speed-up at a fixed k

The memory-bandwidth floor is the fp32 weight bytes read per decode step over the
measured read bandwidth of this machine (a reduction over a 512 MiB tensor).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench_cost import predicted_speedup  # noqa: F401  (re-exported: see below)
from bench_drafts import bench_drafts
from bench_peers import bench_core
from bench_plan import BENCH_PROMPTS, DRAFT_SOURCES, PAIRS, bench_spec, merge_stats  # noqa: F401  (re-exported)
from bench_quant import KEPT, quant_phase, quant_table
from bench_report import drafts_table, print_core, spec_table
from checks import distance_line, dtype_distance, greedy_check, greedy_line

from minispec.errors import InputError, one_line

# The benchmark lives in modules beside this file, by concern: bench_plan (the pairs, prompts and the spec
# benchmark's plan of runs), bench_peers (transformers, llama.cpp, the core benchmark), bench_cost (the cost
# model), bench_report (tables and plot), bench_drafts (the drafts benchmark), checks (greedy, distance).
# This file is the command line; the names imported above stay reachable as bench.NAME (the tests use
# bench.bench_spec, bench.spec_table, bench.merge_stats, bench.predicted_speedup, bench.greedy_check).


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", choices=["core", "spec", "drafts", "greedy", "distance"], nargs="?", default="spec")
    ap.add_argument("--pair", choices=sorted(PAIRS), default="smollm2",
                    help="smollm2 (the default) or coder: Qwen2.5-Coder-1.5B drafted by its 0.5B (make weights-coder)")
    ap.add_argument("--target", default=None, help="the target checkpoint (default: the pair's)")
    ap.add_argument("--draft", default=None, help="the draft checkpoint (default: the pair's)")
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp (coder pair; built by `make bench`)")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers in the spec benchmark")
    ap.add_argument("--quick", action="store_true", help="fewer k values at T=0.7")
    ap.add_argument("--phases", default="quantized,minispec,llama.cpp,transformers",
                    help="the spec benchmark's phases to run (default all four: quantized, the coder pair's kept "
                         "target beside llama.cpp on the shipped files, runs first; the others each re-measure "
                         "target-only)")
    ap.add_argument("--plot", default=None, help="write the spec benchmark's plot to this PNG")
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--ks", default="1,2,3,4,5,6,7,8", help="fixed k values for the spec benchmark")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=None, help="use only the pair's first N prompts")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--target-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="minispec's target dtype in spec and greedy (default float32; bfloat16 where the CPU has "
                         "native bf16 products)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--out", default=None, help="also write the results as JSON to this file")
    return ap


def run_spec(args) -> dict:
    target, draft, texts, ggufs = PAIRS[args.pair]
    phases = [p for p in args.phases.split(",")
              if not (p == "llama.cpp" and args.no_llama or p == "transformers" and args.no_hf)]
    quant = None
    if "quantized" in phases and args.pair in KEPT:  # first: no fp32 copy resident beside llama.cpp's files
        quant = quant_phase(args.pair, texts[:args.prompts], ggufs, args.new_tokens, args.repeats, args.threads,
                            ks=tuple(int(k) for k in args.ks.split(",") if int(k) <= 4))
        print(quant_table(quant), flush=True)
    phases = [p for p in phases if p != "quantized"]
    if not phases:
        return {"quantized": quant}
    res = bench_spec(args.target or target, args.draft or draft, args.new_tokens, args.repeats, args.threads,
                     ks=tuple(int(k) for k in args.ks.split(",")),
                     batch_sizes=tuple(int(b) for b in args.batch_sizes.split(",")),
                     plot=args.plot, quick=args.quick, texts=texts[:args.prompts], ggufs=ggufs,
                     phases=phases, target_dtype=args.target_dtype)
    print(json.dumps(res, indent=2) if args.json else spec_table(res))
    return res if quant is None else {**res, "quantized": quant}


def run_drafts(args) -> dict:
    """The pair's small model as converted, and --draft (e.g. a subset head): fp32, fp16, int4."""
    target, _, texts, _ = PAIRS[args.pair]
    dirs = [DRAFT_SOURCES[args.pair]] + ([args.draft] if args.draft else [])
    options = [(Path(d).name, d, form) for d in dirs for form in ("float32", "float16", "int4")]
    res = bench_drafts(args.target or target, options, texts[:args.prompts], args.new_tokens,
                       int(args.ks.split(",")[0]), args.repeats, args.threads)
    print(json.dumps(res, indent=2) if args.json else drafts_table(res))
    return res


def run_greedy(args) -> dict:
    """Exactness, not speed: greedy speculate equals generate on every bench prompt."""
    target, draft, texts, _ = PAIRS[args.pair]
    res = greedy_check(args.target or target, args.draft or draft, texts[:args.prompts], args.new_tokens,
                       args.threads, args.target_dtype)
    print(json.dumps(res, indent=2) if args.json else greedy_line(res))
    return res


def run_distance(args) -> dict:
    """How far a bf16 target's outputs (or --target's, e.g. the kept quantization) move from the fp32 target's."""
    target, _, texts, _ = PAIRS[args.pair]
    res = dtype_distance(target, texts[:args.prompts], "bfloat16", args.new_tokens, args.threads,
                         other=args.target if args.target and args.target != target else None)
    print(json.dumps(res, indent=2) if args.json else distance_line(res))
    return res


def run_core(args) -> dict:
    res = bench_core(args.new_tokens, args.repeats, args.threads)
    print_core(res, args.json)
    return res


SUBCOMMANDS = {"core": run_core, "spec": run_spec, "drafts": run_drafts, "greedy": run_greedy,
               "distance": run_distance}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        res = SUBCOMMANDS[args.which](args)
    except InputError as e:  # a checkpoint or setting refused: its one line, not a traceback
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 1
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
