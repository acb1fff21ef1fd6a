"""What the CPU does fastest, measured: how many threads a forward step uses (chosen by measuring
steps as they run), which form an fp32 product takes (`product_forms`), and a draft's int4
products (`Int4Weight`).

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
to the tries. A new kind of step starts at the count the last kind ran at; a kind never measured
at the count its family (the same model and batch, other token counts) last ran at runs there
(a prefill comes once a call: measured once at two threads before a load came, it would run at
two under the load for good); a slow step at one
thread sends it to no try (more threads would not help a busier machine). A try of more threads
than the best also needs the cores for them: where the machine says how idle its CPUs were
(Linux's /proc/stat), a try is skipped while fewer cores sat idle than it would add, so under a
lasting load the tuner stops paying for tries of two threads that can only lose (each about 3x a
step on the Zen 4 EPYC measured), and tries again once a core is free. Only CPU steps are
tuned. Set MINISPEC_THREADS=N to fix the count instead.
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
                 slow: float = 1.5, clock=time.perf_counter, set_threads=torch.set_num_threads, idle=None):
        """idle: a function giving the idle CPU-seconds so far of the CPUs this process may run on (see
        idle_seconds), or None: no such information, every try is made."""
        top = max_threads or torch.get_num_threads()
        self.candidates = sorted({max(1, top >> i) for i in range(top.bit_length())}, reverse=True)
        self.decay, self.min_gap, self.max_gap, self.slow = decay, min_gap, max_gap, slow
        self.clock, self.set_threads = clock, set_threads
        self.mean: dict[tuple, dict[int, float]] = {}  # kind of step -> threads -> mean seconds
        self.gap: dict[tuple, int] = {}  # kind -> steps between tries of another count
        self.since: dict[tuple, int] = {}  # kind -> steps since the last try
        self.tries: dict[tuple, int] = {}  # kind -> tries so far (they rotate over the other counts)
        self.current: int | None = None
        self.last_best: int | None = None  # the count the last kind's own steps ran at: where a new kind starts
        self.family_best: dict[tuple, int] = {}  # kind[:-1] (one model and batch, any token count) -> its last count
        self.idle = idle
        self.idle_mark: tuple[float, float] | None = None  # (clock, idle seconds) when idle cores were last measured
        self.spare: float | None = None  # idle cores over the last measured interval
        self.skipped = 0  # tries not made for want of idle cores

    def spare_cores(self) -> float | None:
        """Idle cores on average since the last measurement at least 0.25 s ago (the kernel counts idle time
        in ticks), else the last figure; None until there is one."""
        if self.idle is None:
            return None
        now, idle = self.clock(), self.idle()
        if idle is None:
            return None
        if self.idle_mark is None:
            self.idle_mark = (now, idle)
        elif now - self.idle_mark[0] >= 0.25:
            self.spare = (idle - self.idle_mark[1]) / (now - self.idle_mark[0])
            self.idle_mark = (now, idle)
        return self.spare

    def best(self, kind: tuple) -> int:
        means = self.mean.get(kind)
        return min(means, key=means.get) if means else self.last_best or self.candidates[0]

    def choose(self, kind: tuple) -> int:
        """The thread count for the next step of this kind: the best so far, or a try of another."""
        best = self.best(kind)
        if self.idle_mark is None:
            self.spare_cores()  # the first mark: a later try sees the idle time since
        means, now = self.mean.get(kind), self.family_best.get(kind[:-1])
        if means and now is not None and now not in means:
            return now  # a kind seen before the machine changed (a prefill, once a call): where its family runs now
        self.since[kind] = self.since.get(kind, 0) + 1
        if kind not in self.mean or len(self.candidates) == 1 or self.since[kind] < self.gap.get(kind, self.min_gap):
            return best
        self.since[kind] = 0
        others = [n for n in self.candidates if n != best]
        n = others[(self.tries.get(kind, 0) + 1) % len(others)]
        if n > best:  # more threads need idle cores to run on: without them the try can only lose
            spare = self.spare_cores()
            if spare is not None and spare < 0.5 * (n - best):
                self.skipped += 1
                return best
        self.tries[kind] = self.tries.get(kind, 0) + 1
        return n

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
        self.last_best = self.family_best[kind[:-1]] = threads
        # the machine got busier: try fewer threads soon (already at the fewest: more would not help)
        if old is not None and seconds > self.slow * old and threads > self.candidates[-1]:
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


def idle_seconds(path: str = "/proc/stat"):
    """A function giving the idle (and I/O-wait) CPU-seconds so far of the CPUs this process may run on, read
    from Linux's /proc/stat; None where there is no such file (every try is then made)."""
    try:
        cpus = {f"cpu{i}" for i in os.sched_getaffinity(0)}
        tick = os.sysconf("SC_CLK_TCK")
        with open(path) as f:
            f.read()
    except (OSError, AttributeError, ValueError):
        return None

    def read() -> float | None:
        try:
            with open(path) as f:
                rows = [line.split() for line in f if line.startswith("cpu")]
            return sum(int(r[4]) + int(r[5]) for r in rows if r[0] in cpus) / tick
        except (OSError, ValueError, IndexError):
            return None
    return read


def _from_env() -> ThreadTuner | None:
    fixed = os.environ.get("MINISPEC_THREADS")
    if fixed:
        try:
            torch.set_num_threads(max(1, int(fixed)))
        except ValueError:
            raise ValueError(f"MINISPEC_THREADS must be a positive integer, got {fixed!r}") from None
        return None
    return ThreadTuner(idle=idle_seconds())


TUNER: ThreadTuner | None = _from_env()  # None: the thread count is fixed (MINISPEC_THREADS)


@contextmanager
def tuned(kind: tuple, device: torch.device):
    """The tuner's step context for a CPU step; a no-op elsewhere or when the count is fixed."""
    if TUNER is None or device.type != "cpu":
        yield None
    else:
        with TUNER.step(kind) as n:
            yield n


def _transposed(x, w, b):
    xt = x.reshape(-1, x.shape[-1]).contiguous().t()  # x contiguous: the thin kernel (a transposed x is 3x slower)
    return (torch.mm(w, xt) if b is None else torch.addmm(b.unsqueeze(1), w, xt)).t().reshape(*x.shape[:-1], -1)


# the forms an fp32 CPU product x @ w.T + b can take; PyTorch's own kernels, each picked by shape in its library
PRODUCTS = {"aten": torch.nn.functional.linear,  # MKL's GEMM / GEMV
            "transposed": _transposed,  # (w @ x.T).T: MKL's kernel for a thin right-hand side
            "onednn": lambda x, w, b: torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")}


@functools.cache
def product_forms() -> tuple[str, str]:
    """The fastest form of an fp32 product on this CPU for one row and for 2-512 rows, measured once.

    The libraries pick kernels by shape, and what they pick differs by CPU: on this AVX2 EPYC (PyTorch
    2.13) MKL's x @ w.T costs one matrix-vector pass per row for 2-9 rows, (w @ x.T).T about one pass
    for a few rows, and oneDNN's inner product 0.7 of MKL's time at one row, while over a few rows the
    transposed form led on most of a model's matrices (docs/benchmarks.md, 2026-12-01). Timed once per
    process on an 8192 x 1536 weight (larger than any cache, as a model's are), best of 5 each, at one
    thread: about 0.4 s. At one thread because a timing of several is only as good as the machine's
    quiet: beside a busy process two threads wait on each other, and the Zen 4 EPYC measured then chose
    MKL's one-row product, 2x oneDNN's there quiet, for the whole process (the ranking at one thread
    was the quiet ranking at two, 2026-12-02).
    """
    w, b = torch.randn(8192, 1536), torch.randn(8192)
    forms = [f for f in PRODUCTS if f != "onednn" or torch.backends.mkldnn.is_available()]

    def best(form: str, rows: int) -> float:
        x, times = torch.randn(rows, 1536), []
        for _ in range(6):
            t0 = time.perf_counter()
            PRODUCTS[form](x, w, b)
            times.append(time.perf_counter() - t0)
        return min(times[1:])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            return (min((f for f in forms if f != "transposed"), key=lambda f: best(f, 1)),
                    min(forms, key=lambda f: best(f, 4)))
    finally:
        torch.set_num_threads(threads)


class Int4Weight:
    """A weight matrix in int4 for a draft on a CPU: groups of 32 inputs per row, each with its own scale and
    offset, packed for PyTorch's int4 weight-only product (`_weight_int4pack_mm_for_cpu`, bf16 activations,
    unpacked in the kernel). An eighth of fp32's bytes, so a decode step, which reads every weight once, costs
    far less. Not exact, and it need not be: a draft only proposes (the output stays the target's)."""

    GROUP = 32
    __slots__ = ("packed", "scales", "shape")

    def __init__(self, w: torch.Tensor):
        w = w.detach().float()
        n, k = self.shape = tuple(w.shape)
        g = w.reshape(n, k // self.GROUP, self.GROUP)
        lo, hi = torch.aminmax(g, dim=-1)
        scale = ((hi - lo) / 15).clamp_min(1e-12)
        q = (g - lo[..., None]).mul_((1 / scale)[..., None]).round_().clamp_(0, 15).to(torch.int32).reshape(n, k)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
        # the kernel's weight is (q - 8) * scale + zero, scales and zeros (k / GROUP, n, 2)
        self.scales = torch.stack((scale, lo + 8 * scale), -1).transpose(0, 1).contiguous().bfloat16()

    @classmethod
    def fits(cls, w: torch.Tensor) -> bool:
        """The kernel's shapes: output rows a multiple of 16, inputs of the group."""
        return w.dim() == 2 and w.shape[0] % 16 == 0 and w.shape[1] % cls.GROUP == 0

    def __call__(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, x.shape[-1]).bfloat16(), self.packed,
                                                        self.GROUP, self.scales)
        out = out.to(x.dtype).view(*x.shape[:-1], self.shape[0])
        return out if b is None else out + b


def int4_supported(device: torch.device | str) -> bool:
    """Int4Weight's kernel runs on CPUs."""
    return torch.device(device).type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
