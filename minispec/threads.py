"""The thread count of each forward step on a CPU, chosen by measuring steps as they run.

Decoding on a CPU runs one short parallel matrix product after another. With every core free to
minispec that is fastest with one thread per core; but when another process takes a core, a step's
threads wait at every product for the one that was descheduled, and fewer threads then run faster
than all of them (docs/benchmarks.md, "Threads").

The caller's settings hold. The thread count the caller set (`torch.set_num_threads`, read at the
start of every step) is the ceiling: the tuner chooses among that count, its half, and so on down to
1, and sets the caller's count back after every step, so `torch.set_num_threads(1)` before `generate`
runs every step at one thread. `MINISPEC_THREADS=N` (read at every step, not at import) runs every
step at N threads instead, and also sets the caller's count back afterwards; a value that is not a
positive integer, or is more than the CPUs this process may use, raises ValueError at the first step.
Only CPU steps are tuned.

`ThreadTuner` keeps, per ceiling and kind of step (the model, its batch and token count), a decayed
mean of the step time at each candidate thread count. It runs the best one and tries another now and
then: when a step takes much longer than its mean (the machine got busier), and otherwise after a
back-off that doubles while the choice keeps winning (up to one try in `max_gap` steps), so a quiet
machine loses almost nothing to the tries. A new kind of step starts at the count the last kind ran
at; a kind never measured at the count its family (the same model and batch, other token counts)
last ran at runs there (a prefill comes once a call: measured once at two threads before a load came,
it would run at two under the load for good); a slow step at one thread sends it to no try (more
threads would not help a busier machine). A try of more threads than the best also needs the cores
for them: where the machine says how idle its CPUs were (Linux's /proc/stat), a try is skipped while
fewer cores sat idle than it would add, so under a lasting load the tuner stops paying for tries that
can only lose, and tries again once a core is free. One tuner serves every thread of the process (a server's
pool may step several models at once): a lock keeps one step's choice within its own caller's count.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager

import torch


class ThreadTuner:
    """Per ceiling and kind of step: a mean time per thread count, the best one run, the others tried now and then."""

    def __init__(self, max_threads: int | None = None, decay: float = 0.8, min_gap: int = 8, max_gap: int = 256,
                 slow: float = 1.5, clock=time.perf_counter, set_threads=torch.set_num_threads,
                 get_threads=torch.get_num_threads, idle=None, sleep=time.sleep):
        """max_threads: a fixed ceiling (a simulation's), or None: the caller's count, get_threads(), at each
        step. idle: a function giving the idle CPU-seconds so far of the CPUs this process may run on (see
        idle_seconds), or None: no such information, every try is made. sleep: how the first step waits while
        it counts the idle cores (`first_count`)."""
        self.max_threads = max_threads
        self.decay, self.min_gap, self.max_gap, self.slow = decay, min_gap, max_gap, slow
        self.clock, self.set_threads, self.get_threads = clock, set_threads, get_threads
        # every per-kind table is keyed by (ceiling, kind): a caller that changes its count finds each
        # ceiling's measurements where it left them, and no count above the ceiling is ever chosen
        self.mean: dict[tuple, dict[int, float]] = {}  # (ceiling, kind) -> threads -> mean seconds
        self.gap: dict[tuple, int] = {}  # (ceiling, kind) -> steps between tries of another count
        self.since: dict[tuple, int] = {}  # (ceiling, kind) -> steps since the last try
        self.tries: dict[tuple, int] = {}  # (ceiling, kind) -> tries so far (they rotate over the other counts)
        self.last_best: dict[int, int] = {}  # ceiling -> the count the last kind ran at: a new kind starts there
        self.family_best: dict[tuple, int] = {}  # (ceiling, kind[:-1]): a model and batch, any token count -> count
        self.idle = idle
        self.idle_mark: tuple[float, float] | None = None  # (clock, idle seconds) when idle cores were last measured
        self.spare: float | None = None  # idle cores over the last measured interval
        self.skipped = 0  # tries not made for want of idle cores
        self.ceiling = 0
        self.candidates: list[int] = []
        self.set_ceiling(max_threads or get_threads())
        self.sleep = sleep
        self.lock = threading.Lock()

    def set_ceiling(self, top: int) -> None:
        """Tune within `top` threads: the candidates are top, top // 2, ... down to 1."""
        top = max(1, int(top))
        if top != self.ceiling:
            self.ceiling = top
            self.candidates = sorted({max(1, top >> i) for i in range(top.bit_length())}, reverse=True)

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
        """The best count measured for this kind under the current ceiling (else where a new kind starts)."""
        means = self.mean.get((self.ceiling, kind))
        return min(means, key=means.get) if means else self.last_best.get(self.ceiling) or self.first_count()

    FIRST_LOOK = 0.06  # seconds the first step of a process waits counting idle cores (6 ticks of Linux's 100 Hz)

    def first_count(self) -> int:
        """Where the first kind starts: as many threads as cores sat idle over a short wait (this process
        asleep meanwhile), else the ceiling. Beside a busy process a first prefill at every thread would wait
        on the descheduled one (3x a step at one thread)."""
        if self.idle is None:
            return self.candidates[0]
        t0, i0 = self.clock(), self.idle()
        self.sleep(self.FIRST_LOOK)
        t1, i1 = self.clock(), self.idle()
        if i0 is None or i1 is None or t1 <= t0:
            return self.candidates[0]
        spare = (i1 - i0) / (t1 - t0)
        return next((n for n in self.candidates if spare >= n - 0.5), self.candidates[-1])

    def choose(self, kind: tuple) -> int:
        """The thread count for the next step of this kind: the best so far, or a try of another."""
        key = (self.ceiling, kind)
        best = self.best(kind)
        if self.idle_mark is None:
            self.spare_cores()  # the first mark: a later try sees the idle time since
        means, now = self.mean.get(key), self.family_best.get((self.ceiling, kind[:-1]))
        if means and now is not None and now not in means:
            return now  # a kind seen before the machine changed (a prefill, once a call): where its family runs now
        self.since[key] = self.since.get(key, 0) + 1
        if key not in self.mean or len(self.candidates) == 1 or self.since[key] < self.gap.get(key, self.min_gap):
            return best
        self.since[key] = 0
        others = [n for n in self.candidates if n != best]
        n = others[(self.tries.get(key, 0) + 1) % len(others)]
        if n > best:  # more threads need idle cores to run on: without them the try can only lose
            spare = self.spare_cores()
            if spare is not None and spare < 0.5 * (n - best):
                self.skipped += 1
                return best
        self.tries[key] = self.tries.get(key, 0) + 1
        return n

    def record(self, kind: tuple, threads: int, seconds: float) -> None:
        """A step of this kind took `seconds` with `threads` (under the current ceiling)."""
        key = (self.ceiling, kind)
        means = self.mean.setdefault(key, {})
        best = self.best(kind) if means else threads
        old = means.get(threads)
        if threads != best:  # a try: its fresh time replaces whatever it measured before (the machine may have changed)
            means[threads] = seconds
            held = self.best(kind) == best
            self.gap[key] = min(self.max_gap, 2 * self.gap.get(key, self.min_gap)) if held else self.min_gap
            return
        means[threads] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds
        self.last_best[self.ceiling] = self.family_best[(self.ceiling, kind[:-1])] = threads
        # the machine got busier: try fewer threads soon (already at the fewest: more would not help)
        if old is not None and seconds > self.slow * old and threads > self.candidates[-1]:
            self.gap[key] = self.min_gap
            self.since[key] = max(self.since.get(key, 0), self.min_gap - 1)

    @contextmanager
    def step(self, kind: tuple):
        """Run one step of this kind with the chosen thread count, within the caller's count (the ceiling),
        record its time, and set the caller's count back."""
        current = self.get_threads()
        caller = getattr(_local, "caller", None) or current  # a decoding loop's count (decoding_loop), else PyTorch's
        # one lock over the shared ceiling and tables: steps of other threads (a server's pool) would otherwise
        # swap the ceiling between this one's set_ceiling and choose, and run it above its caller's count
        with self.lock:
            self.set_ceiling(self.max_threads or caller)
            ceiling, n = self.ceiling, self.choose(kind)
        with at_threads(n, current, self.set_threads):
            t0 = self.clock()
            yield n
            seconds = self.clock() - t0
        with self.lock:
            self.set_ceiling(ceiling)  # recorded under the ceiling it was chosen under
            self.record(kind, n, seconds)


@contextmanager
def at_threads(n: int, caller: int, set_threads=torch.set_num_threads):
    """Run the block at n threads and set the caller's count back however it ends."""
    if n != caller:
        set_threads(n)
    try:
        yield n
    finally:
        if n != caller:
            set_threads(caller)


_local = threading.local()  # the compiled products' thread count inside a step (`products_at`), per caller thread


@contextmanager
def products_at(n: int | None):
    """A step, at n threads, of a model whose matrices are (some of them) compiled products (minispec.ggml): the
    products and the compiled blocks run on their own n threads and PyTorch at one thread meanwhile (PyTorch's
    OpenMP threads spin between regions on the very cores the products' threads need: 2.8x slower steps measured
    at two and two), then PyTorch's count is set back. n None: nothing changes."""
    if n is None:
        yield
        return
    before = getattr(_local, "threads", None)
    _local.threads = n
    try:
        with at_threads(1, torch.get_num_threads()):
            yield
    finally:
        _local.threads = before


def product_threads() -> int:
    """The thread count a compiled product runs at here: the step's (`products_at`), else the caller's."""
    return getattr(_local, "threads", None) or caller_threads()


def caller_threads() -> int:
    """The caller's thread count: the one its decoding loop was called with (`decoding_loop`), else PyTorch's now."""
    return getattr(_local, "caller", None) or torch.get_num_threads()


@contextmanager
def decoding_loop():
    """generate's and speculate's loops: PyTorch at one thread between the steps (the logits' checks, sampling, the
    acceptance test), whose OpenMP threads would otherwise spin after each of those small regions on the cores
    the next step's compiled products need (the kept 1.5B's decode steps took 1.2x as long inside generate as
    alone, measured); each step still runs within the caller's count (`caller_threads`), set back at the end.
    A loop inside another keeps the outer one's count; the caller's callbacks run at its count (`as_caller`)."""
    if getattr(_local, "caller", None) is not None:
        yield
        return
    caller = torch.get_num_threads()
    _local.caller = caller
    try:
        with at_threads(1, caller):
            yield
    finally:
        _local.caller = None


def as_caller(fn, *args):
    """fn(*args) with PyTorch at the caller's thread count (a user's callback inside a decoding loop)."""
    with at_threads(caller_threads(), torch.get_num_threads()):
        return fn(*args)


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


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the system has one, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def fixed_threads() -> int | None:
    """MINISPEC_THREADS as a thread count, read now; None when it is unset or empty.

    A value that is not an integer from 1 to the CPUs this process may use raises ValueError: 0 or -1 would
    otherwise have to be read as some other count, and a count far past the CPUs makes every product wait on
    threads that have no core (at 100000 the thread pool itself fails)."""
    value = os.environ.get("MINISPEC_THREADS", "").strip()
    if not value:
        return None
    cpus = usable_cpus()
    n = int(value) if value.isdecimal() and len(value) <= 9 else 0  # isdecimal: no sign, no spaces, no "1_0"
    if not 1 <= n <= cpus:
        raise ValueError(f"MINISPEC_THREADS must be a positive integer no larger than {cpus}, the CPUs this process "
                         f"may use (it is the thread count of every step), got {value[:20]!r}")
    return n


def ceiling() -> int:
    """The most threads a CPU step of minispec may use now: MINISPEC_THREADS when set, else the caller's count."""
    return fixed_threads() or caller_threads()


TUNER = ThreadTuner(idle=idle_seconds())  # every CPU step of every model in this process


@contextmanager
def tuned(kind: tuple, device: torch.device):
    """One step: on a CPU at MINISPEC_THREADS threads when set, else at the tuner's choice within the caller's
    count; either way the caller's count is set back afterwards. A no-op off the CPU."""
    if device.type != "cpu":
        yield None
        return
    fixed = fixed_threads()
    if fixed is None:
        with TUNER.step(kind) as n:
            yield n
        return
    with at_threads(fixed, torch.get_num_threads()):
        yield fixed
