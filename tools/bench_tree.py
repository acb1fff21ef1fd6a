"""Token trees against chains on a real pair: tokens committed per verify pass, and what they cost.

Tokens per verify pass is a count: it does not depend on the machine's load, so it is measured exactly on a
shared machine. For each tree shape the contenders are the tree, the chain of its depth (k = d: the same draft
passes) and the chain with as many drafts as the tree has nodes (k = n: the same verify rows), all on the same
prompts, seeds and sampling settings. Seconds are reported too (tokens/s, the verify pass and a draft pass by
rows, and the cost model's prediction from them: adaptive.round_cost and tree_round_cost); on a busy machine only
the counts are to be trusted, so rerun it quietly for the speeds.

    python tools/bench_tree.py --pair smollm2 --temperature 1.0
    python tools/bench_tree.py --pair coder --target weights/qwen2.5-coder-1.5b-instruct-q4km --temperature 0.7

One line of JSON per contender goes to --out (appended; a contender already there is skipped, so a killed run
resumes where it stopped).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from bench_cost import step_time
from bench_plan import PAIRS
from tqdm import tqdm

from minispec import Transformer
from minispec.adaptive import round_cost, tree_round_cost
from minispec.cli import load_draft
from minispec.speculative import SpeculativeStats
from minispec.tree import DynamicTree, parse_tree, tree_size, tree_text

TREES = "2,2,2 3,2,1 2,2,1,1 3,1,1,1 4,1,1 5x3 4x4"  # at most 16 nodes each, depths 3 and 4; WxD: a DynamicTree


def nodes_depth(t) -> tuple[int, int]:
    """A tree's most nodes and its depth (a DynamicTree: width x depth)."""
    return (t.width * t.depth, t.depth) if isinstance(t, DynamicTree) else (tree_size(t), len(t))


def contenders(trees: list) -> list[tuple[str, dict]]:
    """(name, speculate's k or tree) for every tree and its two chains, each once."""
    out: dict[str, dict] = {}
    for t in trees:
        out[f"tree {tree_text(t)}"] = {"tree": t}
        n, d = nodes_depth(t)
        for k in (d, n):
            out[f"chain k={k}"] = {"k": k}
    return sorted(out.items(), key=lambda kv: (nodes_depth(kv[1]["tree"])[1] if "tree" in kv[1] else 0,
                                               kv[1].get("k", 0)))


def run(target, draft, prompts: list[list[int]], spec: dict, args) -> dict:
    """One contender over every prompt (prompt i sampled from seed + i): tokens per verify pass, tokens/s, and its
    stats' counts. All prompts as one batch unless --single: a batch's rows are independent, so the counts are the
    same either way, and a batched pass costs far less than one pass per prompt; its tokens/s is the batch's."""
    stats, seconds = [], 0.0
    for i, ids in enumerate(prompts if args.single else [prompts]):
        t0 = time.perf_counter()
        res = target.speculate(draft, ids, max_new_tokens=args.tokens, temperature=args.temperature, seed=args.seed + i,
                               stop_tokens=[], **spec)
        seconds += time.perf_counter() - t0
        stats.append(res.stats)
    st = SpeculativeStats.combined(stats)
    return {"tokens_per_pass": st.mean_accepted, "tokens": st.committed, "passes": st.sequence_rounds,
            "drafted_per_pass": st.drafted / st.sequence_rounds, "tokens_per_s": st.committed / seconds}


def costs(target, draft, prompt: list[int], widths: list[int], rows: list[int]) -> dict:
    """Seconds of a target decode step, of the target's pass over r tokens (r in rows), and of a draft pass over w
    tokens (w in widths): each a median of repeats (bench_cost.step_time)."""
    return {"decode": step_time(target, prompt, 1), "verify": {r: step_time(target, prompt, r) for r in rows},
            "draft": {w: step_time(draft, prompt, w) for w in widths}}


def predicted(spec: dict, tokens_per_pass: float, cost: dict) -> float:
    """The cost model's tokens per decode step's time: tokens per pass over the round's cost in decode steps."""
    unit = cost["decode"]
    verify = {r: s / unit for r, s in cost["verify"].items()}
    draft = {w: s / unit for w, s in cost["draft"].items()}
    if "k" in spec:
        k = spec["k"]
        return tokens_per_pass / round_cost(k, draft[1], verify[k + 1])
    t = spec["tree"]
    shape, width = (t.caps, t.width) if isinstance(t, DynamicTree) else (t, None)
    return tokens_per_pass / tree_round_cost(shape, lambda w: draft[w], verify[nodes_depth(t)[0] + 1], width)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", choices=sorted(PAIRS), default="smollm2")
    ap.add_argument("--target", help="the target's directory (default: the pair's)")
    ap.add_argument("--draft", help="the draft's directory (default: the pair's)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--prompts", type=int, default=4, help="how many of the pair's prompts")
    ap.add_argument("--trees", default=TREES, help=f"tree shapes, space-separated (default {TREES!r})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--single", action="store_true", help="one prompt at a time (single-stream tokens/s)")
    ap.add_argument("--no-costs", action="store_true", help="counts only: no step timings, no prediction")
    ap.add_argument("--out", default=None, help="JSON lines, appended (resumes: contenders already there skipped)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    trees = [parse_tree(t) for t in args.trees.split()]
    target_dir, draft_dir, texts, _ = PAIRS[args.pair]
    target = Transformer.from_pretrained(args.target or target_dir)
    draft = load_draft(args.draft or draft_dir, None, target)
    tok = target.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": t}]) for t in texts[:args.prompts]]
    conds = {"pair": args.pair, "target": args.target or target_dir, "temperature": args.temperature,
             "tokens": args.tokens, "prompts": len(prompts), "seed": args.seed, "single": args.single}
    out = Path(args.out) if args.out else None
    done = set()
    if out is not None and out.exists():
        for line in out.read_text().splitlines():
            row = json.loads(line)
            if all(row.get(k) == v for k, v in conds.items()):
                done.add(row["contender"])
    target.speculate(draft, prompts[0], k=2, max_new_tokens=8, stop_tokens=[])  # warm-up: probes, thread tuner
    cost = None
    if not args.no_costs:
        widths = sorted({1, *(w for t in trees for w in ((1, *(t.width,) * (t.depth - 1)) if isinstance(
            t, DynamicTree) else (1, *[tree_size(t[:i]) - tree_size(t[:i - 1]) for i in range(1, len(t))])))})
        rows = sorted({k + 1 for _, spec in contenders(trees)
                       for k in [spec.get("k") or nodes_depth(spec["tree"])[0]]})
        cost = costs(target, draft, prompts[0], widths, rows)
        print(json.dumps({"costs_s": cost, **conds}), flush=True)
    for name, spec in tqdm(contenders(trees), desc="contenders", file=sys.stderr):
        if name in done:
            continue
        row = {"contender": name, **conds, **run(target, draft, prompts, spec, args)}
        if cost is not None:
            row["predicted_tokens_per_step"] = predicted(spec, row["tokens_per_pass"], cost)
        print(json.dumps(row), flush=True)
        if out is not None:
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
