"""Rows against a decode step, minispec beside its peers on the same file: the kept 1.5B's decode step, its passes
of 5 and 9 rows (a verify pass of 4 and 8 drafts, every row's logits) and a 64-token prefill, for each product
built (ik_llama.cpp's row-tiled one, with minispec's own 16-row tiles for Q4_K and Q6_K where the CPU has AVX-512
VNNI, and with ik's interleaved forms instead, MINISPEC_FORM=ik; llama.cpp's; the first also with the blocks in
PyTorch, minispec.fused off),
interleaved round by round with llama-bench's tg32 / pp5 / pp9 / pp64 from llama.cpp mainline and from
ik_llama.cpp (plain and with -rtr 1, its row-interleaved forms); medians, in ms a pass, and each engine's passes
in its own decode steps.

    python tools/bench_rows.py [--rounds 4] [--threads 2]

Needs `make weights-coder`, `python tools/llama_cpp.py` and `python tools/llama_cpp.py --ik` (a peer not built is
left out). Run quiet: every figure here moves with the machine's memory bandwidth.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch
from bench_cost import step_time

from minispec import Transformer

import llama_cpp

TARGET = "weights/qwen2.5-coder-1.5b-instruct-q4km"
GGUF = "weights/gguf/qwen2.5-coder-1.5b-instruct.gguf"
PROMPT = "def quicksort(items):\n    if len(items) <= 1:\n        return items\n    pivot = items[0]\n" * 4


def cpu_name() -> str:
    """The CPU's model name and family/model numbers (/proc/cpuinfo), or the machine's architecture."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().splitlines()[:30] if ":" in line)
    except OSError:
        return platform.machine()
    info = {k.strip(): v.strip() for k, v in info.items()}
    return f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} model {info.get('model', '?')})"


def llama_bench(binary: Path, threads: int, extra: list[str]) -> dict[str, float]:
    """One llama-bench run (tg32, pp5, pp9, pp64, one repetition each) -> ms a pass by test name."""
    out = subprocess.run([str(binary), "-m", GGUF, "-t", str(threads), "-p", "5,9,64", "-n", "32", "-r", "1",
                          "-o", "csv", *extra], capture_output=True, text=True, check=True).stdout
    res = {}
    for row in csv.DictReader(io.StringIO(out)):
        n_gen, n_prompt = int(row["n_gen"]), int(row["n_prompt"])
        name = f"tg{n_gen}" if n_gen else f"pp{n_prompt}"
        res[name] = 1000 / float(row["avg_ts"]) * (1 if n_gen else n_prompt)  # ms a token, or a whole prompt
    return res


def minispec_passes(model, prompt: list[int]) -> dict[str, float]:
    def prefill(n: int) -> float:
        cache = model.new_cache()
        s = cache.new_sequence()
        t = time.perf_counter()
        model.step(cache, [s], [prompt[:n]])
        return time.perf_counter() - t
    return {"tg": step_time(model, prompt, 1, repeats=15) * 1e3, "5 rows": step_time(model, prompt, 5, repeats=5) * 1e3,
            "9 rows": step_time(model, prompt, 9, repeats=5) * 1e3,
            "pp64": statistics.median(prefill(64) for _ in range(3)) * 1e3}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    os.environ["MINISPEC_THREADS"] = str(args.threads)
    models = {}
    for name, product, form in (("minispec iqk", "iqk", ""), ("minispec iqk, ik's forms", "iqk", "ik"),
                                ("minispec ggml", "ggml", "")):
        os.environ["MINISPEC_PRODUCT"], os.environ["MINISPEC_FORM"] = product, form
        models[name] = Transformer.from_pretrained(TARGET)
    del os.environ["MINISPEC_PRODUCT"], os.environ["MINISPEC_FORM"]
    # the same model with its blocks in PyTorch, one call a product (minispec.fused off): what the compiled blocks save
    models["minispec iqk, PyTorch blocks"] = models["minispec iqk"]
    prompt = models["minispec iqk"].tokenizer.encode(PROMPT)[:80]
    peers = {}
    if (d := llama_cpp.bin_dir()) and (d / "llama-bench").is_file():
        peers["llama.cpp"] = (d / "llama-bench", [])
    if d := llama_cpp.ik_bin_dir():
        peers["ik_llama.cpp"] = (d / "llama-bench", [])
        peers["ik_llama.cpp -rtr 1"] = (d / "llama-bench", ["-rtr", "1"])
    res: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.rounds):
        for name, model in models.items():
            model._fused = None if name.endswith("PyTorch blocks") else False  # False: built at the next pass
            for test, ms in minispec_passes(model, prompt).items():
                res.setdefault(name, {}).setdefault(test, []).append(ms)
            model._fused = False
        for name, (binary, extra) in peers.items():
            for test, ms in llama_bench(binary, args.threads, extra).items():
                res.setdefault(name, {}).setdefault("tg" if test == "tg32" else
                                                    {"pp5": "5 rows", "pp9": "9 rows"}.get(test, test), []).append(ms)
    from minispec.forms import GgmlWeight, Stacked
    weights = [m.weight for m in models["minispec iqk"].modules() if hasattr(m, "weight")]
    weights += [models["minispec iqk"].head_packed]
    weights = [p for w in weights for p in (w.parts if isinstance(w, Stacked) else [w])]
    step_bytes = sum(w.blocks.numel() for w in weights if isinstance(w, GgmlWeight))
    print(f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{args.threads} threads, {args.rounds} rounds; medians, ms a pass (in that engine's decode steps)")
    print(f"{'engine':30s} {'decode step':>12s} {'5 rows':>16s} {'9 rows':>16s} {'prefill 64':>18s}")
    for name, tests in res.items():
        step = statistics.median(tests["tg"])
        cells = [f"{statistics.median(tests[t]):7.1f} ({statistics.median(tests[t]) / step:4.2f})"
                 for t in ("5 rows", "9 rows")]
        pp = statistics.median(tests["pp64"])
        print(f"{name:30s} {step:12.1f} {cells[0]:>16s} {cells[1]:>16s} {pp:8.0f} ({64e3 / pp:5.1f} tok/s)")
    step = statistics.median(res["minispec iqk"]["tg"])
    print(f"the kept 1.5B's matrices: {step_bytes / 1e9:.3f} GB read a decode step, {step_bytes / step / 1e6:.1f} GB/s "
          "at minispec iqk's median step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
