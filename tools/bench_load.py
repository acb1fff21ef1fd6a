"""Quiet vs one busy-loop process: SmolLM2 greedy target-only and speculate (k=auto), the thread tuner (default)
against 2 fixed threads and 1; interleaved, 3 repetitions each (or the count given: bench_load.py 5), medians.
`bench_load.py 3 coder`: the kept Qwen2.5-Coder 1.5B (its products through ggml's kernels), target-only, 32 tokens
(its speculate column repeats generate)."""
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ("tuner", "2", "1")  # MINISPEC_THREADS unset (the tuner), then fixed at 2 and at 1
CODE = r'''
import os, sys, time, torch
mode = sys.argv[1]
if mode != "tuner":
    os.environ["MINISPEC_THREADS"] = mode
from minispec import Transformer
ids_msg = [{"role": "user", "content": "Explain how a bicycle stays upright."}]
if sys.argv[2] == "coder":
    t = Transformer.from_pretrained("weights/qwen2.5-coder-1.5b-instruct-q4km")
    ids = t.tokenizer.encode_chat(ids_msg)
    t.generate(ids, max_new_tokens=4, stop_tokens=[])
    a = time.perf_counter(); t.generate(ids, max_new_tokens=32, stop_tokens=[]); b = time.perf_counter()
    print(32 / (b - a), 32 / (b - a))
    sys.exit()
t = Transformer.from_pretrained("weights/smollm2-135m-instruct")
d = Transformer.from_pretrained("weights/smollm2-135m-draft").float()
ids = t.tokenizer.encode_chat(ids_msg)
t.generate(ids, max_new_tokens=8, stop_tokens=[]); t.speculate(d, ids, max_new_tokens=8, stop_tokens=[], k="auto")
a = time.perf_counter(); t.generate(ids, max_new_tokens=96, stop_tokens=[]); b = time.perf_counter()
t.speculate(d, ids, k="auto", max_new_tokens=96, stop_tokens=[]); c = time.perf_counter()
print(96 / (b - a), 96 / (c - b))
'''


def measure(load: str, reps: int, res: dict, pair: str = "smollm2") -> None:
    """`reps` runs of every mode, the order alternating, beside a busy-loop process when `load` is "loaded"."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load == "loaded" else None
    time.sleep(1)
    for rep in range(reps):
        for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
            out = subprocess.run([sys.executable, "-c", CODE, mode, pair], capture_output=True, text=True, cwd=ROOT)
            g, s = map(float, out.stdout.split())
            res.setdefault((load, mode), []).append((g, s))
            print(load, mode, f"generate {g:.1f} tok/s  speculate {s:.1f} tok/s", flush=True)
    if busy:
        busy.kill()


def median(runs: list, i: int) -> float:
    """The median of generate's (i=0) or speculate's (i=1) rate over the runs."""
    return statistics.median(x[i] for x in runs)


def main(argv: list[str]) -> None:
    reps = int(argv[0]) if argv else 3
    pair = argv[1] if len(argv) > 1 else "smollm2"
    res: dict = {}
    for load in ("quiet", "loaded"):
        measure(load, reps, res, pair)
    print("medians:")
    for (load, mode), v in res.items():
        print(load, mode, f"generate {median(v, 0):.1f}  speculate {median(v, 1):.1f}")
    for mode in MODES:
        quiet, loaded = res[("quiet", mode)], res[("loaded", mode)]
        print(mode, "loaded/quiet: generate", round(median(loaded, 0) / median(quiet, 0), 2),
              "speculate", round(median(loaded, 1) / median(quiet, 1), 2))
    for load in ("quiet", "loaded"):  # the goal: the tuner keeps >= 0.9 of the best fixed count under the same load
        for i, what in enumerate(("generate", "speculate")):
            best = max(median(res[(load, m)], i) for m in MODES[1:])
            print(load, what, "tuner / best fixed:", round(median(res[(load, "tuner")], i) / best, 2))


if __name__ == "__main__":
    main(sys.argv[1:])
