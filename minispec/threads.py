"""What the CPU does fastest, measured: how many threads a forward step uses (chosen by measuring
steps as they run) and which form a product over a few rows takes (`transposed_products_win`).

Decoding on a CPU runs one parallel matrix product after another, each only a few
hundred microseconds long. With every core busy with minispec that is fastest with one
thread per core; but when another process takes a core, a step's threads wait at every
product for the one that was descheduled, and two threads on a 2-core machine run at a
third of their quiet speed while one thread keeps most of it (measured on SmolLM2-135M:
16.9 tokens/s quiet with 2 threads, 5.6 with 2 threads beside a busy loop, 14.1 with 1).

`ThreadTuner` keeps, per kind of step (its batch and token count), a decayed mean of the
step time at each candidate thread count (the default count, then halving down to 1). It
runs the best one and tries another now and then: when a step takes much longer than its
mean (the machine got busier), and otherwise after a back-off that doubles while the choice
keeps winning (up to one try in `max_gap` steps), so a quiet machine loses almost nothing
to the tries. Only CPU steps are tuned. Set MINISPEC_THREADS=N to fix the count instead.
"""

from __future__ import annotations

import functools
import os
import time
from contextlib import contextmanager

import torch


class ThreadTuner:
    """Per kind of step: a mean time per thread count, the best one run, the others tried now and then."""

    def __init__(self, max_threads: int | None = None, decay: float = 0.8, min_gap: int = 8, max_gap: int = 256,
                 slow: float = 1.5, clock=time.perf_counter, set_threads=torch.set_num_threads):
        top = max_threads or torch.get_num_threads()
        self.candidates = sorted({max(1, top >> i) for i in range(top.bit_length())}, reverse=True)
        self.decay, self.min_gap, self.max_gap, self.slow = decay, min_gap, max_gap, slow
        self.clock, self.set_threads = clock, set_threads
        self.mean: dict[tuple, dict[int, float]] = {}  # kind of step -> threads -> mean seconds
        self.gap: dict[tuple, int] = {}  # kind -> steps between tries of another count
        self.since: dict[tuple, int] = {}  # kind -> steps since the last try
        self.tries: dict[tuple, int] = {}  # kind -> tries so far (they rotate over the other counts)
        self.current: int | None = None

    def best(self, kind: tuple) -> int:
        means = self.mean.get(kind)
        return min(means, key=means.get) if means else self.candidates[0]

    def choose(self, kind: tuple) -> int:
        """The thread count for the next step of this kind: the best so far, or a try of another."""
        best = self.best(kind)
        self.since[kind] = self.since.get(kind, 0) + 1
        if kind not in self.mean or len(self.candidates) == 1 or self.since[kind] < self.gap.get(kind, self.min_gap):
            return best
        self.since[kind] = 0
        others = [n for n in self.candidates if n != best]
        self.tries[kind] = self.tries.get(kind, 0) + 1
        return others[self.tries[kind] % len(others)]

    def record(self, kind: tuple, threads: int, seconds: float) -> None:
        """A step of this kind took `seconds` with `threads`."""
        means = self.mean.setdefault(kind, {})
        best = self.best(kind) if means else threads
        old = means.get(threads)
        if threads != best:  # a try: its fresh time replaces whatever it measured before (the machine may have changed)
            means[threads] = seconds
            held = self.best(kind) == best
            self.gap[kind] = min(self.max_gap, 2 * self.gap.get(kind, self.min_gap)) if held else self.min_gap
            return
        means[threads] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds
        if old is not None and seconds > self.slow * old:  # the machine got busier: try the others soon
            self.gap[kind] = self.min_gap
            self.since[kind] = max(self.since.get(kind, 0), self.min_gap - 1)

    @contextmanager
    def step(self, kind: tuple):
        """Run one step of this kind with the chosen thread count and record its time."""
        n = self.choose(kind)
        if n != self.current:
            self.set_threads(n)
            self.current = n
        t0 = self.clock()
        yield n
        self.record(kind, n, self.clock() - t0)


def _from_env() -> ThreadTuner | None:
    fixed = os.environ.get("MINISPEC_THREADS")
    if fixed:
        try:
            torch.set_num_threads(max(1, int(fixed)))
        except ValueError:
            raise ValueError(f"MINISPEC_THREADS must be a positive integer, got {fixed!r}") from None
        return None
    return ThreadTuner()


TUNER: ThreadTuner | None = _from_env()  # None: the thread count is fixed (MINISPEC_THREADS)


@contextmanager
def tuned(kind: tuple, device: torch.device):
    """The tuner's step context for a CPU step; a no-op elsewhere or when the count is fixed."""
    if TUNER is None or device.type != "cpu":
        yield None
    else:
        with TUNER.step(kind) as n:
            yield n


@functools.cache
def transposed_products_win() -> bool:
    """Whether this CPU multiplies a few fp32 rows by a weight faster as (w @ x.T).T than as x @ w.T.

    BLAS picks its kernel by the operands' shapes: for 2-9 rows against a wide weight, x @ w.T goes
    to a general kernel that costs one matrix-vector pass per row or two, while w @ x.T takes the
    kernel for a thin right-hand side, about one pass in all (this AVX2 EPYC, PyTorch 2.13, fp32:
    0.2-0.55 the time for 2-9 rows; docs/benchmarks.md, 2026-12-01). Measured once per process on a
    1536 x 1536 weight at 4 rows, best of 5 each, so a CPU whose library does not differ keeps F.linear.
    """
    w, x = torch.randn(1536, 1536), torch.randn(4, 1536)

    def best(fn) -> float:
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)
    with torch.inference_mode():
        return best(lambda: torch.mm(w, x.t())) < 0.8 * best(lambda: torch.nn.functional.linear(x, w))
