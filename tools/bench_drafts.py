"""`tools/bench.py drafts`: draft options side by side against one fp32 target (docs/benchmarks.md, "Drafts").

Each option (a checkpoint in fp32, fp16 or int4) drafts greedily at a fixed k on the same prompts,
interleaved with target-only per prompt (the order alternating); per option: acceptance, tokens per
round, its decode step over the target's, end-to-end tokens/s.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time

import torch
from bench_cost import step_time
from bench_plan import WARM_TOKENS, merge_stats

from minispec import Transformer
from minispec.cli import load_draft


def target_only(target, ids: list[int], n: int) -> tuple[int, None]:
    return len(target.generate(ids, max_new_tokens=n, stop_tokens=[])), None


def drafted(target, draft, k: int, ids: list[int], n: int) -> tuple[int, object]:
    res = target.speculate(draft, ids, k=k, max_new_tokens=n, stop_tokens=[])
    return len(res.tokens), res.stats


def time_runs(runs: list, prompts: list[list[int]], new_tokens: int, repeats: int) -> tuple[list, list, list]:
    """Every run on every prompt, `repeats` times, the order alternating per prompt: seconds per repeat and run,
    tokens per run, stats per run."""
    for run in runs:  # warm up: first touch of the weights, the thread tuner
        run(prompts[0], WARM_TOKENS)
    secs, toks, stats = [[0.0] * len(runs) for _ in range(repeats)], [0] * len(runs), [[] for _ in runs]
    for r in range(repeats):
        for u, ids in enumerate(prompts):
            order = range(len(runs)) if (r + u) % 2 == 0 else range(len(runs) - 1, -1, -1)
            for i in order:
                t = time.perf_counter()
                n, st = runs[i](ids, new_tokens)
                secs[r][i] += time.perf_counter() - t
                toks[i] += n
                stats[i].append(st)
            print(f"prompt {u + 1}/{len(prompts)}", file=sys.stderr, flush=True)
    return secs, toks, stats


def bench_drafts(target_dir: str, options: list[tuple[str, str, str]], texts, new_tokens: int = 128,
                 k: int = 4, repeats: int = 1, threads: int = 2) -> dict:
    """Draft options side by side against one fp32 target: each (label, checkpoint, form: a dtype name or "int4",
    as load_draft takes it) drafts greedily
    at a fixed k on the same prompts, interleaved with target-only per prompt (the order alternating);
    per option: acceptance, tokens per round, its decode step over the target's, end-to-end tokens/s."""
    torch.set_num_threads(threads)
    target = Transformer.from_pretrained(target_dir, dtype=torch.float32)
    drafts = [load_draft(d, None, target, form) for _, d, form in options]
    prompts = [target.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in texts]
    runs = [functools.partial(target_only, target)] + [functools.partial(drafted, target, d, k) for d in drafts]
    secs, toks, stats = time_runs(runs, prompts, new_tokens, repeats)
    t_target = step_time(target, prompts[0], repeats=15) * 1e3
    rates = [statistics.median(toks[i] / repeats / secs[r][i] for r in range(repeats)) for i in range(len(runs))]
    rows = [{"draft": "target-only", "tok_s": rates[0]}]
    for i, (label, _, dt) in enumerate(options, start=1):
        st = merge_stats(stats[i])
        rows.append({"draft": label, "dtype": dt, "tok_s": rates[i], "speedup": rates[i] / rates[0],
                     "acceptance": st.acceptance_rate, "per_round": st.mean_accepted,
                     "draft_step_ratio": step_time(drafts[i - 1], prompts[0], repeats=15) * 1e3 / t_target})
    return {"rows": rows, "k": k, "new_tokens": new_tokens, "prompts": len(prompts), "threads": threads,
            "target_step_ms": t_target}
