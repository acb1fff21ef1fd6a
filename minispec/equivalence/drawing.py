"""Samples drawn from a server under test, whatever its engine: the machinery below every engine's endpoint, the
PIT harness and the two-sample audit.

    drawing = Drawing(endpoint, prompts, counts=[500], tokens=8, params=SamplingParams(0.7, 50, None), seed=0,
                      vocab_size=49152, concurrency=4)
    for prompt, chunk in drawing.chunks(256): ...     # drawn as it is read; or draw(...) / drawing.run() at once
    drawing.drafted, drawing.accepted                 # the draft tokens the engine reported, once drawn

An `Endpoint` is one server as a Drawing uses it: its name for messages, the deadline of one whole answer, the
`Cancel` that ends its requests in flight, and what each engine's subclass says: the request and the checked
answer of one sample (`sample`: its ids and the draft counts it reported), the server's run-wide draft counters
(`counters`, where it keeps some) and the check that it runs the target (`check_model`). The engines:
openai.Endpoint (an OpenAI-compatible completions endpoint, SGLang's /generate) and llama_server.Endpoint
(llama-server's native /completion).

Sample g (prompt-major) is seeded seed + g (with `mixed_seeds` every other sample goes unseeded), and every seed
must lie in [0, SERVER_MAX_SEED], the range every server engine takes. The requests run in daemon threads that a
failure, a stopped reader or Ctrl-C ends at once (`http.Cancel`), so a server that never answers cannot keep the
process alive. The same-model check compares next-token probabilities within PROB_TOLERANCE (`prob_difference`).
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from dataclasses import dataclass, field

import torch

from ..errors import is_int, show
from ..sampling import SamplingParams
from .drafts import Tally, run_counts
from .http import Cancel, ServerError
from .samples import SampleSet, group

SERVER_MAX_SEED = 2**32 - 2  # the smallest seed range of the server engines (llama.cpp's uint32, 0xFFFFFFFF random)
PROB_TOLERANCE = 1e-2  # how far a server's next-token probabilities may be from the target's (fp32)


class ModelMismatchError(ServerError):
    """The server's model is not the --target: one line naming what differs."""


class Endpoint:
    """One server under test, as a Drawing asks of it (see the module's docstring); a subclass per engine.
    url: where it is; name: how messages name it; deadline: seconds per request, the whole answer."""

    kind = ""  # the settings line's engine
    model: str | None = None  # the model its requests name (an OpenAI-compatible server's), else None

    def __init__(self, url: str, name: str, deadline: float, cancel: Cancel | None = None):
        self.url, self.name, self.deadline = url, name, deadline
        self.cancel = cancel or Cancel()

    @property
    def stated(self) -> dict:
        """What a drawing's settings line states about this endpoint's requests."""
        return {"model": self.model}

    def sample(self, prompt: list[int], tokens: int, params: SamplingParams, seed: int | None,
               vocab_size: int) -> tuple[list[int], int | None, int | None]:
        """One sample: its ids, and the draft tokens drafted and accepted the engine reported (or None)."""
        raise NotImplementedError

    def counters(self) -> dict | None:
        """The server's draft counters now ({"drafted", "accepted"}), or None where it keeps none."""
        return None

    def check_model(self, target, prompt: list[int]) -> dict:
        """What was compared of the server's model and the target's; ModelMismatchError where they differ."""
        raise NotImplementedError


def prob_difference(theirs: dict[int, float], target, prompt: list[int]) -> float:
    """The largest difference between a server's next-token probabilities after `prompt` (token id ->
    probability) and the target's (temperature 1, unfiltered); inf when the server gave none."""
    with torch.inference_mode():
        ours = target(torch.tensor([prompt], device=target.device))[0, -1].float().softmax(-1).cpu()
    return max((abs(p - float(ours[i])) for i, p in theirs.items()), default=float("inf"))


def check_seed_range(seed: int, n: int) -> None:
    last = seed + n - 1
    if seed < 0 or last > SERVER_MAX_SEED:
        raise ServerError(f"the seeds seed .. seed + samples - 1 must lie in [0, {SERVER_MAX_SEED}] (llama.cpp's "
                          f"seeds are 32-bit); the last is {last}")


@dataclass
class Drawn:
    """What `draw` brings back: the samples, and the draft tokens the engine reported (None: it tells nothing)."""
    samples: SampleSet
    drafted: int | None = None
    accepted: int | None = None
    requests: int = 0
    notes: list = field(default_factory=list)


class Drawing:
    """counts[j] samples after prompts[j] (sample g prompt-major, seeded seed + g; unseeded for odd g with
    mixed_seeds), `concurrency` requests in flight, drawn as `chunks` is read: stopping reading stops the
    sampling (the requests in flight ended at once). `settings` is the SampleSet's settings line (the endpoint's
    engine, the settings written out, extra `settings` added); once the drawing ends, `drafted` and `accepted` are
    the draft tokens the engine reported (None: it tells nothing), also in settings["speculation"] with their
    acceptance rate (llama.cpp's answers always carry counts, so a zero there is a server that drafted nothing).
    `run()` draws every sample at once. The first failure stops the rest and is raised. Nothing is built per
    sample up front: a job is made as a request thread takes it."""

    def __init__(self, endpoint: Endpoint, prompts: list[list[int]], counts: list[int], tokens: int,
                 params: SamplingParams, seed: int, vocab_size: int, concurrency: int = 1, mixed_seeds: bool = False,
                 settings: dict | None = None, bar=None):
        if not is_int(concurrency) or concurrency < 1:
            raise ServerError(f"concurrency must be an integer >= 1, got {show(concurrency)}")
        self.prompts, self.counts = [list(p) for p in prompts], list(counts)
        self.total = sum(self.counts)
        check_seed_range(seed, self.total)
        self.endpoint, self.tokens, self.params, self.vocab_size = endpoint, tokens, params, vocab_size
        self.seed, self.concurrency, self.mixed_seeds, self.bar = seed, concurrency, mixed_seeds, bar
        self.settings = {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
                         "new_tokens": tokens, "engine": endpoint.kind, "engine_version": None, "url": endpoint.url,
                         **endpoint.stated, "seed": seed, "mixed_seeds": mixed_seeds, "concurrency": concurrency,
                         **(settings or {})}
        self.pairs: list = []  # (prompt, ids) drawn so far, in order
        self.drafted = self.accepted = None
        self.started = False
        self._ends = list(itertools.accumulate(self.counts))
        self._cond = threading.Condition()
        self._out: dict[int, list[int]] = {}  # drawn and not yet read, by sample index
        self._state = {"next": 0, "horizon": 0, "stop": False}  # the next job; jobs below horizon may be drawn
        self._failures: list[BaseException] = []
        self._tally = Tally()

    def _bounds(self, size: int | None):
        """(prompt index, first sample, end) of each chunk, made as they are reached."""
        g = 0
        for j, n in enumerate(self.counts):
            b = size or max(n, 1)
            for s in range(0, n, b):
                yield j, g + s, g + min(n, s + b)
            g += n

    def _job(self) -> int | None:
        """The next sample to draw, once it is below the horizon; None when the drawing stopped or is done."""
        state = self._state
        with self._cond:
            while not state["stop"] and state["horizon"] <= state["next"] < self.total:
                self._cond.wait()
            if state["stop"] or state["next"] >= self.total:
                return None
            state["next"] += 1
            return state["next"] - 1

    def _work(self) -> None:
        """One request thread: draws samples until none is left, handing a failure to the reader."""
        try:
            while (g := self._job()) is not None:
                ids, d, a = self.endpoint.sample(self.prompts[bisect.bisect_right(self._ends, g)], self.tokens,
                                                 self.params, None if self.mixed_seeds and g % 2 else self.seed + g,
                                                 self.vocab_size)
                with self._cond:
                    self._out[g] = ids
                    self._tally.add(d, a)
                    if self.bar is not None:
                        self.bar.update(1)
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the reader, which raises it
            with self._cond:
                self._failures.append(e)
                self._state["stop"] = True
                self._cond.notify_all()
            self.endpoint.cancel()

    def _take(self, lo: int, hi: int) -> list[list[int]]:
        """Samples lo .. hi - 1, waiting for them; the first failure of a request thread is raised here."""
        chunk: list = []
        with self._cond:
            while len(chunk) < hi - lo:
                if lo + len(chunk) in self._out:
                    chunk.append(self._out.pop(lo + len(chunk)))
                elif self._failures:
                    raise self._failures[0]
                else:
                    self._cond.wait(0.25)  # short waits: Ctrl-C reaches the main thread between them
        return chunk

    def chunks(self, size: int | None = None):
        """(prompt, [ids, ...]) for up to `size` consecutive samples of one prompt at a time (all of a prompt's
        when None), in order; the next chunk is drawn while this one is read."""
        if self.started:
            raise ServerError("a Drawing is drawn once")
        self.started = True
        before = self.endpoint.counters()
        # daemon threads: a request stuck on a server that never answers cannot hold the process at its exit
        threads = [threading.Thread(target=self._work, name=f"{self.endpoint.kind}-request-{i}", daemon=True)
                   for i in range(min(self.concurrency, self.total))]
        try:
            for t in threads:
                t.start()
            bounds = self._bounds(size)
            here = next(bounds, None)
            while here is not None:
                ahead = next(bounds, None)
                j, lo, hi = here
                with self._cond:  # the next chunk is drawn meanwhile
                    self._state["horizon"] = (ahead or here)[2]
                    self._cond.notify_all()
                chunk = self._take(lo, hi)
                self.pairs += [(self.prompts[j], t) for t in chunk]
                yield self.prompts[j], chunk
                here = ahead
        except GeneratorExit:  # the reader stopped (an early-stop look failed): so does the sampling
            self.endpoint.cancel()
        except BaseException:
            self.endpoint.cancel()  # every request still in flight ends now: no thread outlives the run for long
            raise
        finally:
            self._stop(threads)
        self._count(before)

    def _stop(self, threads: list[threading.Thread]) -> None:
        with self._cond:
            self._state["stop"] = True
            self._cond.notify_all()
        stop = time.monotonic() + 2.0
        for t in threads:
            t.join(max(0.0, stop - time.monotonic()))
        if self.bar is not None:
            self.bar.close()

    def _count(self, before: dict | None) -> None:
        """The run's draft counts, into `drafted`, `accepted` and the settings line."""
        with self._cond:  # stopped early: the requests that finished (some drawn ahead, never read) are what counted
            known = self._tally.known()
        self.drafted, self.accepted = run_counts(known, before, self.endpoint.counters, self.endpoint.name)
        # every engine's count, zero included: a server that drafted nothing is named as such in the verdict
        if self.drafted is not None:
            self.settings["speculation"] = {"drafted": self.drafted, "accepted": self.accepted, "acceptance_rate":
                                            self.accepted / self.drafted if self.drafted else None}

    def run(self) -> Drawn:
        """Every sample, drawn now."""
        for _ in self.chunks():
            pass
        return Drawn(group(self.settings, self.pairs, self.endpoint.name), self.drafted, self.accepted, self.total)


def draw(endpoint: Endpoint, prompts: list[list[int]], counts: list[int], tokens: int, params: SamplingParams,
         seed: int, vocab_size: int, concurrency: int = 1, mixed_seeds: bool = False, settings: dict | None = None,
         bar=None) -> Drawn:
    """Every sample of a Drawing (see there), drawn at once: the SampleSet and the draft counts the engine
    reported."""
    return Drawing(endpoint, prompts, counts, tokens, params, seed, vocab_size, concurrency, mixed_seeds, settings,
                   bar).run()
