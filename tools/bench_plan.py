"""The spec benchmark's plan of runs: the pairs and prompts, the minispec rows, and timing them interleaved.

Every contender is registered first on a `SpecRun` as parts (one per bench prompt, or one for a
batch), then all of a phase run together, interleaved prompt by prompt, so that a change in the
machine's load hits every contender alike. The peers' phases (llama.cpp, transformers) are in
bench_peers, the cost model in bench_cost, the table and plot in bench_report.
"""

from __future__ import annotations

import functools
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from bench_cost import CostProbe
from bench_peers import llama_phase, transformers_phase
from bench_report import plot_spec

from minispec import Transformer
from minispec.adaptive import expected_tokens
from minispec.cli import load_draft

WARM_TOKENS = 8  # new tokens of each contender's warm-up run

BENCH_PROMPTS = [  # chat prompts never used to train the draft (tools/distill_prompts.py makes those)
    "Explain in a few sentences why the sky looks blue during the day.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are three practical tips for learning a new programming language?",
    "Describe how a bicycle gear system works to a ten-year-old.",
]

# coding and chat prompts for the Qwen2.5-Coder pair; no test uses them
CODER_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation.",
    "Implement binary search over a sorted list in Python and explain its time complexity.",
    "Write a SQL query that returns the five customers with the highest total order value.",
    "Explain the difference between a process and a thread, with a short example in C.",
    "Write a JavaScript function that debounces another function.",
    "Refactor this loop into a list comprehension: result = []\nfor x in data:\n    if x % 2 == 0:\n"
    "        result.append(x * x)",
    "What is a Python decorator? Show one that times a function call.",
    "Write a bash script that counts the lines of every .py file in a directory tree and prints the total.",
]

# name -> the checkpoint the drafts subcommand starts from (the pair's small model as converted)
DRAFT_SOURCES = {"smollm2": "weights/smollm2-135m-draft", "coder": "weights/qwen2.5-coder-0.5b-instruct"}
# name -> (target dir, draft dir, prompts, the GGUF files both were converted from, or None)
PAIRS = {
    "smollm2": ("weights/smollm2-135m-instruct", "weights/smollm2-135m-draft", BENCH_PROMPTS, None),
    "coder": ("weights/qwen2.5-coder-1.5b-instruct", "weights/qwen2.5-coder-0.5b-instruct-draft", CODER_PROMPTS,
              ("weights/gguf/qwen2.5-coder-1.5b-instruct.gguf", "weights/gguf/qwen2.5-coder-0.5b-instruct.gguf")),
}


def merge_stats(stats: list):
    """One SpeculativeStats for several runs (SpeculativeStats.combined), or None when none of them speculated."""
    from minispec.speculative import SpeculativeStats
    stats = [st for st in stats if st is not None]
    return SpeculativeStats.combined(stats) if stats else None


def draft_form(draft: Transformer) -> str:
    """How a draft computes: "int4" (its products) or its dtype's name."""
    return "int4" if draft.config.int4 else str(draft.dtype).removeprefix("torch.")


# A part runs one prompt (or one batch) for n new tokens: part(n) -> (new tokens, stats or None[, seconds as an
# outside engine reports them, without its process start-up]).

def generate_one(model, temperature: float, ids: list[int], i: int, n: int) -> tuple[int, None]:
    return len(model.generate(ids, max_new_tokens=n, temperature=temperature, seed=i, stop_tokens=[])), None


def speculate_one(model, drafter, k, temperature: float, ids: list[int], i: int, n: int) -> tuple[int, object]:
    res = model.speculate(drafter, ids, k=k, max_new_tokens=n, temperature=temperature, seed=i, stop_tokens=[])
    return len(res.tokens), res.stats


def generate_batch(model, batch: list[list[int]], n: int) -> tuple[int, None]:
    out = model.generate(batch, max_new_tokens=n, temperature=0.0, stop_tokens=[])
    return sum(map(len, out)), None


def speculate_batch(model, draft, batch: list[list[int]], n: int) -> tuple[int, object]:
    res = model.speculate(draft, batch, k="auto", max_new_tokens=n, temperature=0.0, stop_tokens=[])
    return sum(map(len, res.tokens)), res.stats


class SpecRun:
    """The spec benchmark's state: the pair, the prompts, the contenders registered for the current phase (`plan`)
    and the rows measured so far. Contenders that cannot share the memory run in a later phase, beside
    target-only again; `phase` numbers them."""

    def __init__(self, target, draft, messages: list, new_tokens: int, repeats: int, threads: int):
        self.target, self.draft, self.messages = target, draft, messages
        self.prompts = [target.tokenizer.encode_chat(m) for m in messages]
        self.new_tokens, self.repeats, self.threads = new_tokens, repeats, threads
        self.rows: list[dict] = []
        self.plan: list[tuple[dict, list]] = []  # (row, parts)
        self.phase = 1

    def parts(self, run_one, *args, items=None) -> list:
        """One part per bench prompt (or per item of `items`, e.g. the chat-rendered prompts):
        run_one(*args, item, index, n)."""
        items = self.prompts if items is None else items
        return [functools.partial(run_one, *args, item, i) for i, item in enumerate(items)]

    def gen(self, temperature: float, model=None) -> list:
        return self.parts(generate_one, model or self.target, temperature)

    def spec(self, drafter, k, temperature: float, model=None) -> list:
        return self.parts(speculate_one, model or self.target, drafter, k, temperature)

    def measure(self, name: str, parts, batch: int = 1, k=None, temperature: float = 0.0) -> dict:
        """Register a contender as parts; run_plan() times them with the others'. Returns its row, which
        run_plan fills in."""
        row = {"engine": name, "batch": batch, "k": k, "temperature": temperature}
        self.plan.append((row, parts))
        return row

    def run_plan(self, probe=None) -> None:
        """Warm every contender up (its first part), then time `repeats` rounds of them (run_round) and add
        their rows. probe(u): called after every prompt's contenders, to measure something in the same
        hour as them (the cost model's step costs)."""
        if not self.plan:  # a phase not asked for (--phases): its number stays taken
            self.phase += 1
            return
        for _, parts in self.plan:  # first touch of the weights, the thread tuner: a few tokens each
            parts[0](WARM_TOKENS)
        rates: list[list[float]] = [[] for _ in self.plan]
        stats: list = [None] * len(self.plan)
        for r in range(self.repeats):
            print(f"round {r + 1}/{self.repeats}", file=sys.stderr, flush=True)
            tokens, secs, st = self.run_round(r, probe)
            for i in range(len(self.plan)):
                rates[i].append(tokens[i] / secs[i])
                stats[i] = merge_stats(st[i])
        for (row, _), rs, st in zip(self.plan, rates, stats):
            self.add_row(row, rs, st)
        self.plan.clear()
        self.phase += 1

    def run_round(self, r: int, probe=None) -> tuple[list[int], list[float], list[list]]:
        """One round: every prompt runs every contender back to back, in alternating order (a b c, then
        c b a, ...), so that a change in the machine's load hits every contender alike; per contender its
        tokens, seconds and stats summed over the prompts. (On a shared machine per-prompt pairs vary far
        less than whole passes over the prompts.)"""
        n = len(self.plan)
        tokens, secs, st = [0] * n, [0.0] * n, [[] for _ in self.plan]
        for u in range(max(len(parts) for _, parts in self.plan)):
            for i in (range(n) if (r + u) % 2 == 0 else range(n - 1, -1, -1)):
                parts = self.plan[i][1]
                if u < len(parts):
                    t = time.perf_counter()
                    count, s_, *own = parts[u](self.new_tokens)  # an outside engine reports its own seconds
                    secs[i] += own[0] if own else time.perf_counter() - t
                    tokens[i] += count
                    st[i].append(s_)
            if probe is not None:
                probe(u)
        return tokens, secs, st

    def add_row(self, row: dict, rates: list[float], st) -> None:
        """A contender's row: its median rate over the rounds and, for a speculative one, what its stats say."""
        row.update(tok_s=statistics.median(rates), runs=rates, phase=self.phase)
        if st is not None:
            a, k = st.acceptance_rate, row["k"]
            row.update(acceptance=a, measured_per_round=st.mean_accepted,
                       predicted_per_round=(expected_tokens(a, k) if isinstance(k, int) else None),
                       mean_k=(statistics.mean(st.k_chosen) if st.k_chosen else None),
                       survival=st.position_acceptance,  # [j]: P(the first j + 1 drafts all accepted)
                       draft_s_round=st.draft_time_s / st.rounds, verify_s_round=st.verify_time_s / st.rounds)
        self.rows.append(row)
        print(f"  {row['engine']:<34} batch {row['batch']:>2}  k={str(row['k']):<5} T={row['temperature']:<4} "
              f"{row['tok_s']:7.1f} tok/s" + (f"  acc {row['acceptance']:.2f}  {row['measured_per_round']:.2f}/round"
                                              if st is not None else ""), file=sys.stderr, flush=True)


def add_minispec_rows(run: SpecRun, ks, quick: bool, target_dtype: str, target_dir: str) -> tuple[dict, dict]:
    """The minispec phase's batch-1 contenders; returns the target-only rows (greedy, T=0.7)."""
    base = run.measure("minispec target-only", run.gen(0.0))
    base_t = run.measure("minispec target-only", run.gen(0.7), temperature=0.7)
    for k in (*ks, "auto"):
        run.measure("minispec speculate", run.spec(run.draft, k, 0.0), k=k)
    for k in ((2, 4, "auto") if quick else (*ks, "auto")):
        run.measure("minispec speculate", run.spec(run.draft, k, 0.7), k=k, temperature=0.7)
    for k in (4, "auto"):
        run.measure("minispec speculate prompt-lookup", run.spec("prompt-lookup", k, 0.0), k=k)
    if target_dtype != "float32":  # the fp32 target beside it, interleaved: the dtype's own ratio
        ref32 = Transformer.from_pretrained(target_dir, dtype=torch.float32)
        run.measure("minispec target-only (float32 target)", run.gen(0.0, ref32))
        run.measure("minispec speculate (float32 target)", run.spec(run.draft, "auto", 0.0, ref32), k="auto")
    return base, base_t


def add_batch_rows(run: SpecRun, batch_sizes) -> None:
    """The minispec phase's batched contenders: target-only and speculate k=auto over each batch size above 1."""
    for bsz in batch_sizes:
        if bsz == 1:
            continue
        batch = [run.prompts[i % len(run.prompts)] for i in range(bsz)]
        run.measure("minispec target-only", [functools.partial(generate_batch, run.target, batch)], batch=bsz)
        run.measure("minispec speculate", [functools.partial(speculate_batch, run.target, run.draft, batch)],
                    batch=bsz, k="auto")


def process_memory_mb(code: str) -> tuple[float, float]:
    """(peak, final) resident memory in MB of a fresh Python process running `code` (Linux /proc)."""
    script = code + ("\nst = dict(l.split(':', 1) for l in open('/proc/self/status'))"
                     "\nprint(int(st['VmHWM'].split()[0]), int(st['VmRSS'].split()[0]))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    peak, final = out.stdout.strip().splitlines()[-1].split()
    return int(peak) / 1024, int(final) / 1024


def resident_memory(target_dir: str, draft_dir: str, threads: int, target_dtype: str, new_tokens: int) -> dict:
    """Resident memory (peak / after the run) of target alone generating and of target + draft speculating."""
    load = (f"import torch; torch.set_num_threads({threads}); from minispec import Transformer; "
            f"t = Transformer.from_pretrained({target_dir!r}, dtype=torch.{target_dtype}); ids = list(range(1, 40))\n")
    mem_target = process_memory_mb(load + f"t.generate(ids, max_new_tokens={new_tokens}, stop_tokens=[])")
    mem_both = process_memory_mb(load + f"from minispec.cli import load_draft; d = load_draft({draft_dir!r}, None, t)\n"
                                 f"t.speculate(d, ids, k=4, max_new_tokens={new_tokens}, stop_tokens=[])")
    return {"rss_mb_target": {"peak": mem_target[0], "after_run": mem_target[1]},
            "rss_mb_target_and_draft": {"peak": mem_both[0], "after_run": mem_both[1]}}


def bench_spec(target_dir: str, draft_dir: str, new_tokens: int = 128, repeats: int = 3, threads: int = 2,
               ks=(1, 2, 3, 4, 5, 6, 7, 8), batch_sizes=(1, 4, 16), plot: str | None = None,
               quick: bool = False, texts=BENCH_PROMPTS, ggufs: tuple[str, str] | None = None,
               phases=("minispec", "llama.cpp", "transformers"), target_dtype: str = "float32") -> dict:
    """The spec benchmark in up to three phases, each re-measuring minispec target-only: minispec's own
    contenders (target-only, speculate over ks and auto, prompt lookup, batches), llama.cpp (coder pair),
    transformers (generate and assisted generation); `phases` names the ones to run. `target_dtype` is
    minispec's target (the speed-ups are against minispec target-only in it); the engines stay fp32."""
    torch.set_num_threads(threads)
    target = Transformer.from_pretrained(target_dir, dtype=getattr(torch, target_dtype))
    draft = load_draft(draft_dir, None, target)  # as stored (the coder draft is fp16), a bf16 one in fp32
    run = SpecRun(target, draft, [[{"role": "user", "content": p}] for p in texts], new_tokens, repeats, threads)
    costs = CostProbe(target, draft, run.prompts, max(ks))
    base, base_t = {"tok_s": None}, {"tok_s": None}
    if "minispec" in phases:
        base, base_t = add_minispec_rows(run, ks, quick, target_dtype, target_dir)
        add_batch_rows(run, batch_sizes)
    run.run_plan(costs)
    if not costs.samples:  # no minispec phase: the costs measured once, here
        costs(0, 15)
    if "llama.cpp" in phases and ggufs is not None:
        llama_phase(run, ggufs)
    if "transformers" in phases:
        transformers_phase(run, target_dir, draft_dir, ggufs)
    res = {"target": Path(target_dir).name, "draft": Path(draft_dir).name, "rows": run.rows, "new_tokens": new_tokens,
           "repeats": repeats, "threads": threads, "prompts": len(run.prompts), **costs.summary(),
           **resident_memory(target_dir, draft_dir, threads, target_dtype, new_tokens),
           "draft_dtype": draft_form(draft), "target_dtype": target_dtype, "baseline_tok_s": base["tok_s"],
           "baseline_t07_tok_s": base_t["tok_s"]}
    if plot:
        plot_spec(res, plot)
    return res
