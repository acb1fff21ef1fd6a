"""The thread tuner: it runs the fastest measured count, notices when the machine changes, and backs off."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from minispec import threads
from minispec.threads import ThreadTuner

from helpers import tiny_model

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


def test_step_sets_the_count_only_when_it_differs_from_the_callers_and_sets_it_back():
    now = {"threads": 2}
    calls = []

    def set_threads(n):
        calls.append(n)
        now["threads"] = n
    t = iter(range(100))
    tuner = ThreadTuner(set_threads=set_threads, get_threads=lambda: now["threads"], clock=lambda: next(t) * 0.01)
    for _ in range(3):
        with tuner.step(KIND) as n:
            assert n == 2
    assert calls == []  # the caller's count is the best: nothing to set
    tuner.record(KIND, 1, 0.001)  # one thread measured faster
    tuner.record(KIND, 1, 0.001)
    with tuner.step(KIND) as n:
        assert n == 1 and now["threads"] == 1
    assert calls == [1, 2] and now["threads"] == 2  # set back after the step


def test_the_ceiling_is_the_callers_count_read_at_every_step():
    now = {"threads": 4}
    t = iter(range(10_000))
    tuner = ThreadTuner(set_threads=lambda n: None, get_threads=lambda: now["threads"], clock=lambda: next(t) * 0.01)
    for _ in range(50):
        with tuner.step(KIND):
            pass
    assert tuner.candidates == [4, 2, 1]
    tuner.record(KIND, 2, 0.0001)  # at a ceiling of 4, two threads measured fastest
    tuner.record(KIND, 2, 0.0001)
    assert tuner.best(KIND) == 2
    now["threads"] = 1  # the caller asks for one thread: no other count is ever chosen
    for _ in range(300):
        with tuner.step(KIND) as n:
            assert n == 1
    assert tuner.candidates == [1] and tuner.best(KIND) == 1
    now["threads"] = 2
    used = []
    for _ in range(300):
        with tuner.step(KIND) as n:
            used.append(n)
    assert set(used) <= {1, 2} and tuner.candidates == [2, 1]
    now["threads"] = 4  # the measurements under a ceiling of 4 are where they were left
    tuner.set_ceiling(4)
    assert tuner.best(KIND) == 2


def test_the_first_kind_starts_at_the_threads_the_idle_cores_take():
    """The first step of a process (a prefill, once a call) starts at as many threads as cores sat idle over a
    short wait: beside a busy process on a 2-core machine, at one."""
    for idle_cores, first in ((0.0, 1), (1.0, 1), (1.4, 1), (1.7, 2), (2.0, 2)):
        now = {"t": 0.0, "idle": 0.0}

        def sleep(s, now=now, idle_cores=idle_cores):
            now["t"] += s
            now["idle"] += s * idle_cores
        tuner = ThreadTuner(max_threads=2, clock=lambda now=now: now["t"], idle=lambda now=now: now["idle"],
                            sleep=sleep)
        assert tuner.choose(KIND) == first, idle_cores
        tuner.record(KIND, first, 0.05)
        assert tuner.choose(KIND[:-1] + ("other",)) == first  # a new kind starts where the last one ran
    no_info = ThreadTuner(max_threads=2, idle=None)
    assert no_info.choose(KIND) == 2  # no idle information: the caller's count


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
    stat.write_text("\n".join(["cpu  10 0 5 300 7 0 0 0 0 0", "cpu0 5 0 2 100 3 0 0 0 0 0",
                               "cpu1 5 0 3 200 4 0 0 0 0 0", "intr 1", ""]))
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


# ---------------------------------------------------------------------------
# the caller's thread count holds in generate and speculate
# ---------------------------------------------------------------------------

@pytest.fixture
def callers_threads():
    """Restore the process's thread count whatever a test sets."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _step_threads(monkeypatch, *models) -> list[int]:
    """torch.get_num_threads() inside every forward step of `models`, recorded as they run."""
    seen = []
    for m in models:
        trunk = m._trunk
        monkeypatch.setattr(m, "_trunk", lambda *a, trunk=trunk, **kw: seen.append(torch.get_num_threads())
                            or trunk(*a, **kw))
    return seen


def test_one_thread_set_before_generate_runs_every_step_at_one_thread(monkeypatch, callers_threads):
    monkeypatch.delenv("MINISPEC_THREADS", raising=False)
    target, draft = tiny_model(seed=1), tiny_model(seed=2, n_layers=1)
    seen = _step_threads(monkeypatch, target, draft)
    torch.set_num_threads(1)
    target.generate([[1, 2, 3], [4, 5]], max_new_tokens=12, stop_tokens=[])
    target.speculate(draft, [1, 2, 3], k=3, max_new_tokens=12, temperature=1.0, seed=0, stop_tokens=[])
    assert len(seen) > 20 and set(seen) == {1}
    assert torch.get_num_threads() == 1


def test_the_callers_count_is_set_back_after_the_tuners_choice(monkeypatch, callers_threads):
    monkeypatch.delenv("MINISPEC_THREADS", raising=False)
    tuner = ThreadTuner(idle=None)
    monkeypatch.setattr(tuner, "choose", lambda kind: tuner.candidates[-1])  # the tuner picks one thread
    monkeypatch.setattr(threads, "TUNER", tuner)
    model = tiny_model(seed=1)
    seen = _step_threads(monkeypatch, model)
    torch.set_num_threads(2)
    model.generate([1, 2, 3], max_new_tokens=8, stop_tokens=[])
    assert set(seen) == {1} and tuner.candidates == [2, 1]
    assert torch.get_num_threads() == 2


def test_minispec_threads_fixes_the_count_of_every_step_and_sets_the_callers_back(monkeypatch, callers_threads):
    model = tiny_model(seed=1)
    seen = _step_threads(monkeypatch, model)
    torch.set_num_threads(2)
    monkeypatch.setenv("MINISPEC_THREADS", "1")  # read when used, not at import
    model.generate([1, 2, 3], max_new_tokens=8, stop_tokens=[])
    assert set(seen) == {1} and torch.get_num_threads() == 2
    from minispec.equivalence.harness import max_threads
    assert max_threads() == 1
    monkeypatch.delenv("MINISPEC_THREADS")
    assert max_threads() == 2
    for bad in ("two", "0", "-1"):
        monkeypatch.setenv("MINISPEC_THREADS", bad)
        with pytest.raises(ValueError, match="MINISPEC_THREADS must be a positive integer"):
            model.generate([1, 2, 3], max_new_tokens=2)
        assert torch.get_num_threads() == 2


def test_a_decoding_loop_runs_pytorch_at_one_thread_between_its_steps_and_the_steps_at_the_callers(
        monkeypatch, callers_threads):
    monkeypatch.delenv("MINISPEC_THREADS", raising=False)
    tuner = ThreadTuner(idle=None)
    monkeypatch.setattr(tuner, "choose", lambda kind: tuner.candidates[0])  # the tuner takes the ceiling
    monkeypatch.setattr(threads, "TUNER", tuner)
    target, draft = tiny_model(seed=1), tiny_model(seed=2, n_layers=1)
    seen = _step_threads(monkeypatch, target, draft)
    torch.set_num_threads(2)
    between, called = [], []
    import minispec.generate as generate_module
    check = generate_module.check_logits
    monkeypatch.setattr(generate_module, "check_logits",
                        lambda logits: between.append(torch.get_num_threads()) or check(logits))
    target.generate([[1, 2, 3], [4, 5]], max_new_tokens=6, stop_tokens=[],
                    on_tokens=lambda i, toks: called.append(torch.get_num_threads()))
    target.speculate(draft, [1, 2, 3], k=3, max_new_tokens=6, temperature=1.0, seed=0, stop_tokens=[],
                     on_tokens=lambda i, toks: called.append(torch.get_num_threads()))
    # the steps at the caller's 2, the logits' checks between them at 1, the caller's callbacks at its 2
    assert len(seen) > 8 and set(seen) == {2} and set(between) == {1} and called and set(called) == {2}
    assert torch.get_num_threads() == 2 and threads.caller_threads() == 2
    with threads.decoding_loop():
        assert torch.get_num_threads() == 1 and threads.caller_threads() == threads.ceiling() == 2
        with threads.decoding_loop():  # a loop inside another keeps the outer one's count
            assert threads.caller_threads() == 2
    with pytest.raises(RuntimeError), threads.decoding_loop():  # set back however it ends
        raise RuntimeError
    assert torch.get_num_threads() == 2 and threads.caller_threads() == 2


def test_a_bad_environment_does_not_break_import():
    env = dict(os.environ, MINISPEC_THREADS="lots", MINISPEC_KERNELS="fastest")
    code = ("import minispec\n"
            "cfg = minispec.ModelConfig(vocab_size=16, dim=16, n_layers=1, n_heads=2, max_seq_len=8)\n"
            "m = minispec.Transformer(cfg)\n"
            "try:\n    m.generate([1, 2], max_new_tokens=1)\nexcept ValueError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "must be" in out.stdout


def test_a_step_never_runs_above_its_callers_count_while_another_thread_steps():
    counts = threading.local()  # each thread's own "torch.set_num_threads", as PyTorch keeps it per thread
    get = lambda: getattr(counts, "n", 2)  # noqa: E731

    def put(n):
        counts.n = n
    tuner = ThreadTuner(set_threads=put, get_threads=get, min_gap=1, max_gap=1)
    choose = tuner.choose

    def choose_after_a_switch(kind):  # the other thread gets the interpreter at the worst moment
        time.sleep(0)
        return choose(kind)
    tuner.choose = choose_after_a_switch
    seen, stop = [], threading.Event()

    def busy():  # another thread's steps, at its caller's 2
        counts.n = 2
        while not stop.is_set():
            with tuner.step(("other",)):
                pass
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # hand the interpreter between the threads as often as it will go
    other = threading.Thread(target=busy)
    other.start()
    try:
        put(1)  # this thread's caller runs at one thread
        for _ in range(1000):
            with tuner.step(("mine",)) as n:
                seen.append((n, get()))
    finally:
        stop.set()
        other.join()
        sys.setswitchinterval(before)
    assert {n for n, _ in seen} == {1} and {inside for _, inside in seen} == {1}
