"""The thread tuner: it runs the fastest measured count, notices when the machine changes, and backs off."""

from __future__ import annotations

import os

import pytest

from minispec.threads import ThreadTuner

KIND = (576, 30, 1, 1)


def simulate(tuner: ThreadTuner, cost, steps: int) -> list[int]:
    """Run `steps` steps whose time is cost(step, threads); return the thread count of each."""
    used = []
    for i in range(steps):
        n = tuner.choose(KIND)
        tuner.record(KIND, n, cost(i, n))
        used.append(n)
    return used


def test_candidates_halve_down_to_one():
    assert ThreadTuner(max_threads=8).candidates == [8, 4, 2, 1]
    assert ThreadTuner(max_threads=2).candidates == [2, 1]
    assert ThreadTuner(max_threads=1).candidates == [1]


def test_quiet_machine_keeps_all_threads_and_tries_rarely():
    tuner = ThreadTuner(max_threads=2)
    used = simulate(tuner, lambda i, n: 0.030 if n == 2 else 0.036, 2000)
    assert used[0] == 2 and used[-100:].count(2) == 100
    tries = used.count(1)
    assert 3 <= tries <= 12, tries  # the back-off doubles from 8 steps to 256: few tries over 2000 steps


def test_a_busy_core_moves_to_one_thread_and_back_when_it_is_free():
    tuner = ThreadTuner(max_threads=2)
    quiet = lambda n: 0.030 if n == 2 else 0.036  # noqa: E731
    busy = lambda n: 0.090 if n == 2 else 0.043  # two threads wait on each other when one core is taken  # noqa: E731
    used = simulate(tuner, lambda i, n: quiet(n) if i < 500 or i >= 1500 else busy(n), 2500)
    loaded = used[500:1500]
    assert loaded[20:].count(1) >= 0.97 * len(loaded[20:])  # switched within a few steps of the load arriving
    assert used[1500 + 300:].count(2) >= 0.95 * len(used[1800:])  # and back once a try sees the core free


def test_kinds_are_tuned_apart():
    tuner = ThreadTuner(max_threads=2)
    for _ in range(300):
        for kind, fast in (((1,), 2), ((2,), 1)):
            n = tuner.choose(kind)
            tuner.record(kind, n, 0.01 if n == fast else 0.02)
    assert tuner.best((1,)) == 2 and tuner.best((2,)) == 1


def test_a_new_kind_starts_where_the_machine_is_and_one_thread_ignores_slow_steps():
    tuner = ThreadTuner(max_threads=2)
    busy = lambda i, n: 0.090 if n == 2 else (0.043 if i % 5 else 0.1)  # one thread, now and then descheduled  # noqa: E731
    used = simulate(tuner, busy, 600)
    assert used[50:].count(2) <= 4  # slow one-thread steps do not send it back to trying two threads
    assert tuner.best(("a new kind",)) == 1  # a new kind of step starts at the count the machine favours now


def test_step_sets_the_count_only_when_it_changes():
    calls = []
    t = iter(range(100))
    tuner = ThreadTuner(max_threads=2, set_threads=calls.append, clock=lambda: next(t) * 0.01)
    for _ in range(3):
        with tuner.step(KIND) as n:
            assert n == 2
    assert calls == [2]


def test_no_tries_of_more_threads_while_no_core_is_idle(tmp_path):
    """Where the machine reports idle time: under a lasting load two threads can only lose, so they are not
    tried until a core sits idle again; then a try sees the free core and the tuner moves back."""
    from minispec.threads import idle_seconds
    now = {"t": 0.0, "idle": 0.0}
    tuner = ThreadTuner(max_threads=2, clock=lambda: now["t"], idle=lambda: now["idle"])
    plain = ThreadTuner(max_threads=2)  # no idle information: tries as before
    busy = lambda n: 0.090 if n == 2 else 0.043  # noqa: E731
    quiet = lambda n: 0.030 if n == 2 else 0.036  # noqa: E731
    used, used_plain = [], []
    for i in range(3000):
        loaded = 200 <= i < 2000
        n = tuner.choose(KIND)
        sec = busy(n) if loaded else quiet(n)
        now["t"] += sec
        now["idle"] += 0.0 if loaded or n == 2 else sec  # one thread on a quiet 2-core machine: a core idles
        tuner.record(KIND, n, sec)
        used.append(n)
        m = plain.choose(KIND)
        plain.record(KIND, m, busy(m) if loaded else quiet(m))
        used_plain.append(m)
    assert used[300:2000].count(2) == 0 and tuner.skipped >= 5  # no two-thread try under the load
    assert used_plain[300:2000].count(2) >= 4  # without idle information the tries go on
    assert used[2300:].count(2) >= 0.95 * len(used[2300:])  # the load gone: back to two threads
    stat = tmp_path / "stat"
    stat.write_text("\n".join(["cpu  10 0 5 300 7 0 0 0 0 0", "cpu0 5 0 2 100 3 0 0 0 0 0", "cpu1 5 0 3 200 4 0 0 0 0 0",
                               "intr 1", ""]))
    read = idle_seconds(str(stat))
    tick = os.sysconf("SC_CLK_TCK")
    own = {f"cpu{i}" for i in os.sched_getaffinity(0)}
    assert read() == pytest.approx(((103 if "cpu0" in own else 0) + (204 if "cpu1" in own else 0)) / tick)
    assert idle_seconds(str(tmp_path / "missing")) is None


def test_a_kind_seen_once_before_the_load_runs_where_the_machine_is_now():
    """A prefill comes once a call: measured at two threads on a quiet machine, it must not stay there once
    every other step has moved to one thread under a load."""
    tuner = ThreadTuner(max_threads=2)
    prefill, decode, other = ("target", 37), ("target", 1), ("draft", 1)  # kind[:-1]: the model (and batch)
    tuner.record(prefill, tuner.choose(prefill), 0.2)  # quiet: two threads
    for _ in range(100):  # the load arrives: decode steps move to one thread
        n = tuner.choose(decode)
        tuner.record(decode, n, 0.090 if n == 2 else 0.043)
    assert tuner.best(decode) == 1 and tuner.best(prefill) == 2
    for _ in range(3):  # another model's steps, at two threads, do not move this model's prefill
        tuner.record(other, 2, 0.01)
    n = tuner.choose(prefill)
    assert n == 1
    tuner.record(prefill, n, 0.15)
    assert tuner.best(prefill) == 1 and tuner.choose(prefill) == 1
