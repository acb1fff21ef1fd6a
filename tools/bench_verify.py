"""A verify pass against a decode step on one model: 5, 9 and 17 rows (k = 4, 8, 16), the trunk alone (a greedy
round's) and with every row's logits (a sampled round's), interleaved repetitions, medians, in decode steps.
`python tools/bench_verify.py [MODEL_DIR] [REPS]` (default: the kept Qwen2.5-Coder 1.5B, 5 repetitions;
MINISPEC_THREADS fixes the thread count, as docs/benchmarks.md's figures do at 2)."""

import os
import statistics
import sys

from bench_cost import step_time

from minispec import Transformer

PROMPT = "def quicksort(items):\n    if len(items) <= 1:\n        return items\n    pivot = items[0]\n"


def main(argv: list[str]) -> None:
    path = argv[0] if argv else "weights/qwen2.5-coder-1.5b-instruct-q4km"
    reps = int(argv[1]) if len(argv) > 1 else 5
    model = Transformer.from_pretrained(path)
    prompt = model.tokenizer.encode(PROMPT)
    res: dict = {}
    for _ in range(reps):
        for n in (1, 5, 9, 17):
            res.setdefault((n, "trunk"), []).append(step_time(model, prompt, n, repeats=5, hidden=n > 1))
            if n > 1:
                res.setdefault((n, "logits"), []).append(step_time(model, prompt, n, repeats=5))
    one = statistics.median(res[(1, "trunk")])
    print(f"{path}, MINISPEC_THREADS={os.environ.get('MINISPEC_THREADS', '(tuner)')}: decode step {one * 1e3:.1f} ms")
    for n in (5, 9, 17):
        h, lg = statistics.median(res[(n, "trunk")]), statistics.median(res[(n, "logits")])
        print(f"  {n:2d} rows: trunk {h * 1e3:.1f} ms = {h / one:.2f} steps; every row's logits {lg * 1e3:.1f} ms = "
              f"{lg / one:.2f} steps")


if __name__ == "__main__":
    main(sys.argv[1:])
