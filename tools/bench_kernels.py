"""The kernel table: every candidate product for a kept 1.5B's matrix shapes, by rows and threads.

For each shape (the 1.5B's q/o 1536 x 1536, k/v 256 x 1536, gate/up 8960 x 1536, down 1536 x 8960 and the
151,936-row head) and each candidate, the median time of a product of 1, 2, 3, 4, 5, 8, 9, 12 and 16 rows at
1 and 2 threads, the GB/s of the weight's bytes that makes, and whether every row's output bits are the
same in a pass of every row count as computed alone (a kept target's exactness needs it). Candidates:

- `ggml q4_k`, `ggml q6_k`: a GGUF's own blocks through llama.cpp's kernels (minispec.ggml; skipped if the
  library is not built);
- `aten int4`: PyTorch's `_weight_int4pack_mm_for_cpu` (forms.Int4Weight, the int4 groups form);
- `aten int8`: PyTorch's `_weight_int8pack_mm` (forms.Int8Weight, the int8 rows form);
- `bf16`, `fp32`: the dense float product (`F.linear`; fp32 through kernels.linear's probed form).

Random weights (valid blocks); the timing, not the values, is the point. Run quiet, e.g. `nice -n -5
python tools/bench_kernels.py`; about 4 minutes on 2 cores. `--quick` times fewer row counts.

`--model DIR` times a kept model's whole passes instead: a decode step, and passes of 5 and 9 new tokens
(a verify pass of 4 and 8 drafts) in decode steps, the bytes a step reads from its matrices and the GB/s
that makes, and the share of the step spent in the products (the rest: attention, norms, RoPE, Python).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from minispec import forms, ggml, kernels

SHAPES = {"q/o 1536x1536": (1536, 1536), "k/v 256x1536": (256, 1536), "gate/up 8960x1536": (8960, 1536),
          "down 1536x8960": (1536, 8960), "head 151936x1536": (151936, 1536)}
ROWS = (1, 2, 3, 4, 5, 8, 9, 12, 16)


def random_blocks(kind: str, n: int, k: int, seed: int) -> torch.Tensor:
    """(n, row bytes) valid blocks: random bytes, the fp16 scales small and finite."""
    _, values, size = ggml.TYPES[kind]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (n * k // values, size), dtype=np.uint8)
    d = (rng.random((len(b), 2)) * 0.01).astype(np.float16).view(np.uint8)
    if kind == "q6_k":
        b[:, -2:] = d[:, :2]  # d last
    else:
        b[:, 0:4] = d  # d and dmin first
    return torch.from_numpy(b.reshape(n, -1))


def candidates(n: int, k: int, seed: int) -> dict:
    """name -> (product function of x, weight bytes)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    out = {}
    for product in ggml.PRODUCTS:  # each built product, chosen as a user does (MINISPEC_PRODUCT)
        before = os.environ.get("MINISPEC_PRODUCT")
        os.environ["MINISPEC_PRODUCT"] = product
        try:
            for kind in ("q4_k", "q6_k"):
                if ggml.takes(kind, k):
                    gw = forms.GgmlWeight(kind, random_blocks(kind, n, k, seed), k)
                    out[f"{product} {kind}"] = (gw.product, gw.blocks.numel())
        finally:
            os.environ.pop("MINISPEC_PRODUCT") if before is None else os.environ.update(MINISPEC_PRODUCT=before)
    # the bar: fbgemm's int8 GEMM (torch's dynamically quantized Linear, u8 activations x s8 weights), twice the
    # bytes of Q4_K
    lin = torch.nn.Linear(k, n, bias=False)
    lin.weight.data.copy_(w)
    fb = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(lin), {torch.nn.Linear}, dtype=torch.qint8)
    out["fbgemm int8"] = (fb, n * k + n * 4)
    i4 = forms.Int4Weight(w)
    out["aten int4"] = (i4.product, i4.packed.numel() * i4.packed.element_size() + i4.scales.numel() * 2)
    parts = forms.int8_rows(w)
    i8 = forms.Int8Weight(parts["q8"], parts["q8_scale"])
    out["aten int8"] = (i8.product, n * k + n * 2)
    wb = w.bfloat16()
    out["bf16"] = (lambda x: F.linear(x.bfloat16(), wb), n * k * 2)
    out["fp32"] = (lambda x: kernels.linear(x, w), n * k * 4)
    return out


def median_ms(fn, x, reps: int) -> float:
    fn(x)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def model_passes(path: str, reps: int) -> None:
    """A kept model's decode step and 5- and 9-token passes, medians of `reps`, with the products' share."""
    from bench_quant import packed_bytes

    from minispec import Transformer
    model = Transformer.from_pretrained(path)
    cache = model.new_cache()
    seq = cache.new_sequence()
    model.step(cache, [seq], [list(range(100, 164))])
    spent = [0.0]
    inner = forms.GgmlWeight.product

    def timed(self, rows):
        t0 = time.perf_counter()
        out = inner(self, rows)
        spent[0] += time.perf_counter() - t0
        return out
    forms.GgmlWeight.product = timed
    nbytes = packed_bytes(model)
    try:
        for rows in (1, 5, 9):
            times, shares = [], []
            for r in range(reps + 1):
                fork = cache.fork(seq)
                spent[0] = 0.0
                t0 = time.perf_counter()
                model.step(cache, [fork], [list(range(200 + r, 200 + r + rows))], all_logits=True)
                dt = time.perf_counter() - t0
                cache.free(fork)
                if r:
                    times.append(dt)
                    shares.append(spent[0] / dt)
            ms = statistics.median(times) * 1e3
            if rows == 1:
                step = ms
            print(f"{rows} rows: {ms:7.1f} ms ({ms / step:4.2f} decode steps), products "
                  f"{100 * statistics.median(shares):3.0f}% of it, {nbytes / 1e9:.3f} GB of matrices "
                  f"({nbytes / ms / 1e6:5.1f} GB/s)", flush=True)
    finally:
        forms.GgmlWeight.product = inner


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="rows 1, 5, 9, 16 only")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names from: " + ", ".join(SHAPES))
    p.add_argument("--threads", default="1,2")
    p.add_argument("--model", help="a kept model's directory: time its passes instead of the products")
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args(argv)
    if args.model:
        with torch.inference_mode():
            model_passes(args.model, args.reps)
        return 0
    rows = (1, 5, 9, 16) if args.quick else ROWS
    threads_before = torch.get_num_threads()
    print(f"torch {torch.__version__}; ms (GB/s of weight bytes); 'same bits' = every row equals it computed alone")
    try:
        with torch.inference_mode():
            for si, name in enumerate(args.shapes.split(",")):
                n, k = SHAPES[name]
                x = torch.randn(max(rows), k, generator=torch.Generator().manual_seed(si))
                forms = candidates(n, k, si)
                reps = 5 if n * k > 1e8 else 15
                for form, (fn, nbytes) in forms.items():
                    alone = torch.cat([fn(x[i:i + 1]).float() for i in range(max(rows))])
                    same = all(torch.equal(fn(x[:r]).float(), alone[:r]) for r in rows)
                    for t in map(int, args.threads.split(",")):
                        torch.set_num_threads(t)
                        cells = []
                        for r in rows:
                            ms = median_ms(fn, x[:r], reps)
                            cells.append(f"{ms:7.3f} ({nbytes / ms / 1e6:5.1f})")
                        print(f"{name:18} {form:10} {t}t same bits {'yes' if same else 'NO ':3} | "
                              + " ".join(f"{r}:{c}" for r, c in zip(rows, cells)), flush=True)
                del forms
    finally:
        torch.set_num_threads(threads_before)
    return 0


if __name__ == "__main__":
    sys.exit(main())
