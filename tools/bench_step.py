"""Where a pass of the kept 1.5B spends its time, in CPU time at one thread (less moved by a neighbour than wall
time): a decode step, a 9-row pass and a 64-token prefill with the compiled blocks (minispec.fused) and with the
blocks in PyTorch, alternated round by round, medians; then the products alone (the blocks' matrices and the head,
each called once a row count), so the rest of a pass is its difference.

    python tools/bench_step.py [--rounds 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

TARGET = "weights/qwen2.5-coder-1.5b-instruct-q4km"


def cpu_ms(fn, repeats: int) -> float:
    """The least CPU time of `repeats` calls, in ms."""
    times = []
    for _ in range(repeats):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return min(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args(argv)
    os.environ["MINISPEC_THREADS"] = "1"
    torch.set_num_threads(1)
    from minispec import Transformer
    from minispec.forms import GgmlWeight, Stacked

    model = Transformer.from_pretrained(TARGET)
    prompt = list(range(100, 180))
    res: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for name, fused in (("compiled blocks", False), ("PyTorch blocks", None)):
            model._fused = fused  # False: built at the next pass; None: the PyTorch blocks
            cache = model.new_cache()
            s = cache.new_sequence()
            model.step(cache, [s], [prompt])
            for rows, key in ((1, "decode step"), (9, "9 rows")):
                def once(rows=rows, cache=cache, s=s):
                    model.step(cache, [s], [prompt[-rows:]], all_logits=rows > 1)
                    cache.truncate(s, len(prompt))
                res.setdefault((name, key), []).append(cpu_ms(once, 5 if rows == 1 else 3))

            def prefill():
                c = model.new_cache()
                model.step(c, [c.new_sequence()], [prompt[:64]])
            res.setdefault((name, "prefill 64"), []).append(cpu_ms(prefill, 1))
    model._fused = False
    weights = [m.weight for m in model.modules() if hasattr(m, "weight")]
    weights = [w for v in weights for w in (v.parts if isinstance(v, Stacked) else [v]) if isinstance(w, GgmlWeight)]
    head = model.lm_head.weight if model.lm_head is not None else model.head_packed
    blocks = [w for w in weights if w is not head]
    print(f"CPU ms at one thread, medians of {args.rounds} rounds (each the least of a few calls), torch "
          f"{torch.__version__}")
    for (name, key), v in sorted(res.items()):
        print(f"  {name:16s} {key:12s} {statistics.median(v):8.1f}")
    for rows in (1, 9):
        xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
        b = cpu_ms(lambda xs=xs: [w.product(xs[w.shape[1]]) for w in blocks], 5)
        h = cpu_ms(lambda xs=xs: head.product(xs[head.shape[1]]), 5) if isinstance(head, GgmlWeight) else 0.0
        print(f"  products alone, {rows} row(s): the blocks' {len(blocks)} matrices {b:.1f}, the head {h:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
