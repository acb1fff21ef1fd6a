"""Products alone on the kept 1.5B's own matrices, 2 threads: minispec's 16-row tiles (where the CPU has AVX-512
VNNI), the same matrices in ik_llama.cpp's interleaved forms (MINISPEC_FORM=ik) and fbgemm's int8 GEMM (torch's
dynamically quantized Linear: the rate to reach, with twice Q4_K's bytes), ms a product of 1, 5, 9 and 16 rows
(per row), best of 5 batches, interleaved; the tiles' GB/s at one row and multiply-adds a second above.
Each matrix is called repeatedly, so all but the head sit in L3.

    python tools/bench_tiles.py   (about 30 s; run quiet)
"""

from __future__ import annotations

import os
import time
import warnings

import torch

from minispec import Transformer
from minispec.forms import GgmlWeight, Stacked

TARGET = "weights/qwen2.5-coder-1.5b-instruct-q4km"


def matrices(model) -> dict:
    """One GgmlWeight of each (kind, shape) in the model, the head included."""
    out = {}
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        for p in (w.parts if isinstance(w, Stacked) else [w]):
            if isinstance(p, GgmlWeight):
                out.setdefault((p.kind, p.shape), p)
    head = model.lm_head.weight if model.lm_head is not None else model.head_packed
    out.setdefault((head.kind, head.shape), head)
    return out


def best_ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e3


def main() -> int:
    torch.set_num_threads(2)
    os.environ["MINISPEC_THREADS"] = "2"
    forms = {}
    for name, form in (("tiles", ""), ("ik", "ik")):
        os.environ["MINISPEC_FORM"] = form
        forms[name] = matrices(Transformer.from_pretrained(TARGET))
    del os.environ["MINISPEC_FORM"]
    print(f"torch {torch.__version__}, 2 threads; ms a product (per row): own tiles | ik's forms | fbgemm int8")
    for key, w in sorted(forms["tiles"].items(), key=lambda kv: -kv[0][1][0] * kv[0][1][1]):
        kind, (n, k) = key
        ik = forms["ik"][key]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao's deprecation notices
            q = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)),
                                                       {torch.nn.Linear}, dtype=torch.qint8)
        reps = max(1, int(3e7 / (n * k)))
        print(f"{n} x {k} {kind} ({w.blocks.numel() / 1e6:.1f} MB; run as type {w._run[1]})")
        for r in (1, 5, 9, 16):
            x = torch.randn(r, k)
            a, b, c = (best_ms(lambda f=f, x=x: f(x), reps) for f in (w.product, ik.product, q))
            rate = f"{w.blocks.numel() / a / 1e6:5.1f} GB/s" if r == 1 else f"{r * n * k / a / 1e6:5.0f} G MAC/s"
            print(f"  {r:2d}: {a:7.3f} ({a / r:6.3f}) | {b:7.3f} ({b / r:6.3f}) | {c:7.3f} ({c / r:6.3f})   [{rate}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
