"""The two-sample audit: no weights, just the engine's speculative samples beside reference samples drawn with
speculation off (the same server with no draft, or another deployment of the same model).

    report = compare(speculative, reference)        # two SampleSets with the same settings and prompts
    print(report.format()); report.passed

Under exactness both runs sample the target's distribution, so at every position the token counts of the two
runs are alike: stats.homogeneity tests that (per position and pooled, prompt by prompt, Holm-corrected), and
power.two_sample_power states the smallest bias it would have caught. It needs no model, so a laptop can audit
a deployment too large for it; the price is power (no model to score against: both runs carry sampling noise,
and only each position's token counts are compared), so it wants more samples than the PIT for the same bias.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .power import RUNS, Power, two_sample_power
from .samples import MIN_SAMPLES, SETTINGS_KEYS, EquivalenceInputError, SampleSet, group
from .stats import PERMUTATIONS, TwoSample, homogeneity, look_alphas


@dataclass
class TwoSampleReport:
    settings: dict
    test: TwoSample
    power: Power | None = None
    drafted: int | None = None  # draft tokens the engine reported proposing (None: it tells nothing)
    accepted: int | None = None
    notes: list[str] = field(default_factory=list)
    speed: dict = field(default_factory=dict)
    sequential: dict = field(default_factory=dict)  # the early-stop looks (audit): count, level, whether one stopped

    @property
    def passed(self) -> bool:
        return self.test.passed

    @property
    def calibrated(self) -> None:
        return None  # no calibration run: nothing is scored under a model

    @property
    def verdict(self) -> str:
        word = "passed" if self.passed else "failed"
        parts = [word] + ([self.power.phrase()] if self.power is not None else [])
        if self.drafted == 0:
            parts.append("the engine drafted no tokens, so this run tested plain sampling, not speculation")
        elif self.drafted is not None:
            parts.append(f"the engine reported {self.drafted} draft tokens, {self.accepted} accepted")
        return "; ".join(parts)

    def to_dict(self) -> dict:
        return {"passed": self.passed, "verdict": self.verdict, "mode": "two-sample", "calibrated": None,
                "drafted": self.drafted, "accepted": self.accepted, "settings": self.settings,
                "two_sample": self.test.to_dict(), "power": None if self.power is None else self.power.to_dict(),
                "sequential": self.sequential, "speed": self.speed, "notes": self.notes}

    def format(self) -> str:
        s, t = self.settings, self.test
        lines = [f"equivalence (two-sample, no model): {s['under_test']} against {s['reference']}",
                 f"  {t.n_a} and {t.n_b} sample(s) x {s['tokens']} tokens, {s['prompts']} prompt(s); "
                 f"temperature={s['temperature']}, top_k={s['top_k']}, top_p={s['top_p']}",
                 "  chi-square homogeneity of each position's token counts (rare tokens pooled), prompt by prompt, "
                 f"and pooled (by {t.permutations} permutations); Holm over {len(t.p)} tests", "",
                 f"  {'position':>8} {'chi2':>10} {'df':>5} {'p':>10} {'p_holm':>10}"]
        for w, c, d, p, a in zip(t.row_names, t.stats, t.dfs, t.p, t.adjusted):
            lines.append(f"  {w:>8} {c:>10.2f} {d:>5} {p:>10.3g} {a:>10.3g}")
        lines += ["", f"verdict: {'PASSED' if self.passed else 'FAILED'} ({self.verdict})",
                  f"  at alpha={t.alpha:.3g}: smallest Holm-adjusted p = {t.min_adjusted:.3g}"]
        if self.sequential.get("stopped_early"):
            lines.append(f"  stopped early: the first {t.n_a} and {t.n_b} samples already failed at an early look "
                         "(a clear failure; the rest were not drawn)")
        if self.drafted is not None:
            rate = f", acceptance {self.accepted / self.drafted:.3f}" if self.drafted and self.accepted is not None \
                else ""
            lines.append(f"speculation: the engine reported {self.drafted} draft token(s) proposed, "
                         f"{self.accepted} accepted{rate}")
        else:
            lines.append("speculation: the engine reported no draft counts, so whether it drafted is not known")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _matrix(samples: SampleSet) -> tuple[np.ndarray, np.ndarray, dict]:
    index = {tuple(p): j for j, p in enumerate(samples.prompts)}
    groups = np.array([index[tuple(p)] for _, p in samples.per_sample_prompts()], dtype=np.int64)
    return np.array(samples.tokens, dtype=np.int64).reshape(len(samples.tokens), -1), groups, index


def compare(test: SampleSet, reference: SampleSet, alpha: float = 0.01, seed: int = 0, power_runs: int = RUNS,
            permutations: int = PERMUTATIONS, drafted: int | None = None, accepted: int | None = None,
            names: tuple[str, str] | None = None, notes=()) -> TwoSampleReport:
    """The two-sample verdict on samples under test against reference samples with the same settings (temperature,
    top-k, top-p, new tokens) and prompts. EquivalenceInputError when they cannot be compared."""
    t0 = time.perf_counter()
    for k in ("temperature", "top_k", "top_p", "new_tokens"):
        if test.settings[k] != reference.settings[k]:
            raise EquivalenceInputError(f"the two runs differ in {k} ({test.settings[k]!r} under test, "
                                        f"{reference.settings[k]!r} in the reference): compare like with like")
    if test.settings["temperature"] == 0:
        raise EquivalenceInputError("temperature 0: greedy runs are compared token for token, not by counts; "
                                    "the two-sample audit needs temperature > 0")
    a, ga, ia = _matrix(test)
    b, gb, ib = _matrix(reference)
    if set(ia) != set(ib):
        raise EquivalenceInputError("the two runs have different prompts; draw the reference after the same ones")
    gb = np.array([ia[tuple(reference.prompts[j])] for j in gb], dtype=np.int64)  # one numbering for both
    if min(len(a), len(b)) < MIN_SAMPLES:
        raise EquivalenceInputError(f"the two-sample audit needs at least {MIN_SAMPLES} samples in each run; got "
                                    f"{len(a)} and {len(b)}")
    labels = names or (test.source, reference.source)
    result = homogeneity(a, b, ga, gb, alpha=alpha, permutations=permutations, seed=seed, labels=labels)
    power = two_sample_power(a, b, alpha, ga, gb, runs=power_runs, seed=seed) if power_runs else None
    s = test.settings
    settings = {**{k: s[k] for k in SETTINGS_KEYS}, "tokens": s["new_tokens"], "prompts": len(test.prompts),
                "under_test": labels[0], "reference": labels[1], "alpha": alpha, "seed": seed,
                "engine_settings": {k: v for k, v in s.items() if k not in SETTINGS_KEYS},
                "reference_settings": {k: v for k, v in reference.settings.items() if k not in SETTINGS_KEYS}}
    report = TwoSampleReport(settings, result, power, drafted, accepted, list(notes))
    if drafted == 0:
        report.notes.append("the engine reported 0 drafted tokens: the samples under test are plain sampling")
    report.speed = {"test_s": time.perf_counter() - t0, **({"power_s": power.seconds} if power else {})}
    return report


def audit(test, reference, batch_size: int = 256, alpha: float = 0.01, seed: int = 0, power_runs: int = RUNS,
          permutations: int = PERMUTATIONS, names: tuple[str, str] | None = None) -> TwoSampleReport:
    """compare() on two servers' Drawings (minispec.equivalence.drawing), drawn chunk by chunk in step, with the
    early-stop looks of the PIT harness: after each pair of chunks but the last, the samples so far are compared at
    stats.EARLY_ALPHA * alpha / (number of looks), and a failure there stops both drawings; the final comparison runs
    at the alpha left. The engine's draft counts come from the drawing under test."""
    runs = [test.chunks(batch_size), reference.chunks(batch_size)]
    looks = max(sum(-(-n // batch_size) for n in test.counts) - 1, 0)
    a_look, a_final = look_alphas(alpha, looks)  # the early-stop rule (stats.EARLY_ALPHA)
    taken, stopped = 0, False
    try:
        for _ in range(looks):
            if any(next(r, None) is None for r in runs):
                break
            taken += 1
            a, b = (group(d.settings, d.pairs, d.endpoint.name) for d in (test, reference))
            if min(len(a.tokens), len(b.tokens)) >= MIN_SAMPLES and not compare(
                    a, b, alpha=a_look, seed=seed, power_runs=0, permutations=permutations).passed:
                stopped = True
                break
        if not stopped:
            for r in runs:
                for _ in r:
                    pass
    finally:
        for r in runs:
            r.close()  # a stopped drawing ends its requests and reads its counters
    report = compare(group(test.settings, test.pairs, test.endpoint.name),
                     group(reference.settings, reference.pairs, reference.endpoint.name),
                     alpha=a_look if stopped else a_final, seed=seed, power_runs=power_runs,
                     permutations=permutations, drafted=test.drafted, accepted=test.accepted, names=names)
    report.sequential = {"interim_looks": looks, "interim_alpha": a_look, "final_alpha": a_final,
                         "looks_taken": taken, "stopped_early": stopped, "samples_tested": len(test.pairs)}
    return report
