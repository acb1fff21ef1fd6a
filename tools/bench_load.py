"""Quiet vs one busy-loop process: SmolLM2 greedy target-only and speculate (k=auto), the thread tuner (default)
against 2 fixed threads and 1; interleaved, 3 repetitions each (or the count given: bench_load.py 5), medians."""
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
code = r'''
import os, sys, time, torch
mode = sys.argv[1]
if mode != "tuner": os.environ["MINISPEC_THREADS"] = mode
from minispec import Transformer
t = Transformer.from_pretrained("weights/smollm2-135m-instruct"); d = Transformer.from_pretrained("weights/smollm2-135m-draft").float()
ids = t.tokenizer.encode_chat([{"role": "user", "content": "Explain how a bicycle stays upright."}])
t.generate(ids, max_new_tokens=8, stop_tokens=[]); t.speculate(d, ids, max_new_tokens=8, stop_tokens=[], k="auto")
a = time.perf_counter(); t.generate(ids, max_new_tokens=96, stop_tokens=[]); b = time.perf_counter()
t.speculate(d, ids, k="auto", max_new_tokens=96, stop_tokens=[]); c = time.perf_counter()
print(96 / (b - a), 96 / (c - b))
'''
reps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
res = {}
for load in ("quiet", "loaded"):
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load == "loaded" else None
    time.sleep(1)
    for rep in range(reps):
        for mode in (("tuner", "2", "1") if rep % 2 == 0 else ("1", "2", "tuner")):
            out = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, cwd=ROOT)
            g, s = map(float, out.stdout.split())
            res.setdefault((load, mode), []).append((g, s))
            print(load, mode, f"generate {g:.1f} tok/s  speculate {s:.1f} tok/s", flush=True)
    if busy: busy.kill()
print("medians:")
for (load, mode), v in res.items():
    print(load, mode, f"generate {statistics.median(x[0] for x in v):.1f}  speculate {statistics.median(x[1] for x in v):.1f}")
for mode in ("tuner", "2", "1"):
    q, l = res[("quiet", mode)], res[("loaded", mode)]
    print(mode, "loaded/quiet: generate", round(statistics.median(x[0] for x in l) / statistics.median(x[0] for x in q), 2),
          "speculate", round(statistics.median(x[1] for x in l) / statistics.median(x[1] for x in q), 2))
