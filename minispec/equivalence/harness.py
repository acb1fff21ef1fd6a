"""The harness: draw (or read) the samples under test, score them under the target, calibrate, report.

`run_equivalence` tests an engine it drives (minispec's speculate, or transformers:
minispec.equivalence.engines), `audit_samples` samples drawn elsewhere (a samples file:
minispec.equivalence.samples). Both end in `_verdict`: the samples under test, scored chunk by
chunk as they are drawn (with early-stop looks), and the target-only calibration run go
through the same `target_pit` pass and the same tests (minispec.equivalence.stats); the power
figure (minispec.equivalence.power) comes from the tested rows.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .. import __version__
from ..adaptive import AdaptiveK
from ..controls import Control
from ..drafters import check_tree_drafter, make_drafter
from ..errors import check_int, is_number, normalize_prompts
from ..sampling import SamplingParams, logits_to_probs
from ..speculative import ExactSampler, get_sampler
from ..tree import AUTO_SHAPES, DynamicTree, check_tree, tree_size, tree_text
from .drawing import Drawing
from .engines import ENGINES, TransformersEngine
from .llama_server import ENGINE as LLAMA_CPP
from .power import HEAD, RUNS, Power, detectable_bias, head_rows
from .samples import MIN_SAMPLES, SETTINGS_KEYS, EquivalenceInputError, SampleSet, group, read_samples, validate
from .stats import ORDERS, RunStats, analyse, look_alphas, pit

# The defaults (Hugging Face's top_k=50, a common temperature) give each negative control of
# minispec.controls a real effect: temperature != 1 and top-k make the processed q differ from the
# raw softmax (what a control of the draft's draw needs; top-k more than doubles that effect on
# SmolLM2), and any draft that is not the target is rejected often enough for a control of the
# acceptance step to show.
DEFAULTS = dict(samples=2000, tokens=8, k=4, temperature=0.7, top_k=50, top_p=None, seed=0, sampler="exact",
                alpha=0.01, bins=20, batch_size=256, power_runs=RUNS)


@dataclass
class _Scored:
    """Samples scored under the target as they were drawn: PIT values, head rows for the power, timings."""
    pairs: list = field(default_factory=list)  # (prompt, tokens) in the order drawn
    u: dict = field(default_factory=dict)  # order -> list of (b, T) arrays
    head: list = field(default_factory=list)  # (p, f_id) per chunk
    impossible: int = 0
    sample_s: float = 0.0
    pit_s: float = 0.0
    looks: int = 0  # interim looks taken
    stopped: bool = False  # an interim look already failed, so sampling stopped there

    def u_all(self) -> dict:
        return {o: np.concatenate(v, axis=0) for o, v in self.u.items()}

    def head_all(self) -> tuple[np.ndarray, np.ndarray]:
        return tuple(np.concatenate([h[i] for h in self.head], axis=0) for i in (0, 1))


def _score(target, chunks, params: SamplingParams, rng: np.random.Generator, orders, bins: int, interim: int,
           alpha_look: float, head: int) -> _Scored:
    """Score the chunks (prompt, samples) as they are drawn (chunks is lazy: stopping stops the sampling). After
    each of the first `interim` chunks, stop if the samples so far already fail at level alpha_look."""
    out = _Scored(u={o: [] for o in orders})
    it = iter(chunks)
    while True:
        t0 = time.perf_counter()
        chunk = next(it, None)
        t1 = time.perf_counter()
        out.sample_s += t1 - t0
        if chunk is None:
            break
        prompt, tokens = chunk
        u, impossible, rows = target_pit(target, [prompt], tokens, params, rng, orders, head=head)
        out.pairs += [(prompt, t) for t in tokens]
        for o in orders:
            out.u[o].append(u[o])
        if rows is not None:
            out.head.append(rows)
        out.impossible += impossible
        out.pit_s += time.perf_counter() - t1
        if out.looks < interim:
            out.looks += 1
            if not analyse(out.u_all(), alpha_look, bins).passed:
                out.stopped = True
                break
    if hasattr(it, "close"):
        it.close()  # a generator stopped early: its progress bar closes
    return out


def _chunked(counts: list[int], batch_size: int):
    """(prompt index, first sample index of the chunk within the run, chunk size) over every prompt's samples."""
    g = 0
    for j, n in enumerate(counts):
        for start in range(0, n, batch_size):
            b = min(batch_size, n - start)
            yield j, g, b
            g += b


def _minispec_chunks(target, draft, prompts, counts, T, params: SamplingParams, k, sampler, seed, batch_size,
                     stats: dict, bar, tree=None):
    """Samples from minispec in chunks of batch_size: speculate(draft, ...), or generate when draft is None (the
    target-only calibration). Sample g of the run (prompt-major) uses seed + g whatever the chunking."""
    try:
        yield from _minispec_draws(target, draft, prompts, counts, T, params, k, sampler, seed, batch_size, stats, bar,
                                   tree)
    finally:
        if bar is not None:
            bar.close()


# The distributions one speculate call of the harness may hold, about: a round keeps the target's and the draft's
# (drafts + 1, V) float64 rows per sequence, so a 256-sample batch of a 15-node tree over a 152k vocabulary would
# hold ~19 GB; such a batch is drawn in several calls instead (the same samples: sequence i draws from seed + i).
SAMPLING_BYTES = 4 * 2**30


def _drafts_per_row(k, tree) -> int:
    """The most draft tokens a round proposes for one sequence under these settings."""
    if tree == "auto":
        return max(tree_size(shape) for shape in AUTO_SHAPES)
    if isinstance(tree, DynamicTree):
        return tree_size(tree.caps, tree.width)
    if tree is not None:
        return tree_size(tuple(tree))
    if isinstance(k, AdaptiveK):
        return k.k_max
    return AdaptiveK().k_max if isinstance(k, str) else k


def rows_per_call(vocab_size: int, k, tree) -> int:
    """Sequences per speculate call of the harness: as many as keep the call's distributions within SAMPLING_BYTES."""
    return max(1, SAMPLING_BYTES // ((_drafts_per_row(k, tree) + 1) * vocab_size * 8 * 2))


def _minispec_draws(target, draft, prompts, counts, T, params, k, sampler, seed, batch_size, stats, bar, tree=None):
    most = batch_size if draft is None else rows_per_call(target.config.vocab_size, k, tree)
    for j, g, b in _chunked(counts, batch_size):
        calls = -(-b // most)
        tokens = []
        for c in range(calls):  # a look's batch in equal calls of at most `most` sequences
            lo, hi = b * c // calls, b * (c + 1) // calls
            kw = dict(max_new_tokens=T, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                      seed=seed + g + lo, stop_tokens=[])
            if draft is None:
                tokens += target.generate([prompts[j]] * (hi - lo), **kw)
                continue
            r = target.speculate(draft, [prompts[j]] * (hi - lo), sampler=sampler,
                                 **({"k": k} if tree is None else {"tree": tree}), **kw)
            tokens += r.tokens
            for name in ("drafted", "accepted", "committed", "sequence_rounds"):
                stats[name] = stats.get(name, 0) + getattr(r.stats, name)
        _check_lengths(tokens, T, "the sampler")
        if bar is not None:
            bar.update(b)
        yield prompts[j], tokens


def _check_lengths(tokens, T: int, who: str) -> None:
    for t in tokens:
        if len(t) != T:
            raise RuntimeError(f"a sample has {len(t)} tokens, expected {T} (stop tokens are disabled): "
                               f"{who} ended a sequence early")


def _n_chunks(counts: list[int], batch_size: int) -> int:
    return sum(-(-n // batch_size) for n in counts)


def target_pit(target, prompts: list[list[int]], samples: list[list[int]], params: SamplingParams,
               rng: np.random.Generator, orders=ORDERS, max_logits_bytes: int = 1 << 26,
               block_size: int = 16, counts: list[int] | None = None,
               head: int = 0) -> tuple[dict[str, np.ndarray], int, tuple[np.ndarray, np.ndarray] | None]:
    """PIT values of samples (prompt-major: counts[j] after prompts[j], n each by default) under the target:
    order -> (n_total, T); how many sampled tokens had target probability 0 (impossible under target-only
    sampling); and with head > 0 each row's `head` most likely tokens for the power simulation
    (power.head_rows: (n_total, T, head) probabilities and F_id), else None.
    Every order uses the same uniforms U.

    One batched target pass per prompt: the prompt (all but its last token) is prefilled once
    into a paged cache and forked to every sample, then `step(..., all_logits=True)` runs
    [last prompt token, x_1 .. x_{T-1}] and returns the T distributions p_1..p_T in one call.
    The pass only appends, never rolls back, so a rollback bug in the sampler under test cannot
    reach the reference. Chunked so the logits stay under max_logits_bytes.
    """
    if counts is None:
        counts = [len(samples) // len(prompts)] * len(prompts)
    T = len(samples[0])
    V = target.config.vocab_size
    chunk = max(1, max_logits_bytes // (T * V * 4))
    us, impossible, heads = {o: [] for o in orders}, 0, []
    offsets = np.cumsum([0] + list(counts))
    for j, prompt in enumerate(prompts):
        P, n = len(prompt), counts[j]
        x = torch.tensor(samples[offsets[j]:offsets[j + 1]], dtype=torch.long)  # (n, T)
        fed = torch.cat([torch.tensor(prompt[-1:], dtype=torch.long).expand(n, 1), x[:, :-1]], dim=1)  # (n, T)
        per_seq = -(-(P + T) // block_size) + 1  # a forked partial prompt block is copied on write
        shared = -(-(P - 1) // block_size)
        cache = target.new_cache(num_blocks=shared + min(chunk, n) * per_seq, block_size=block_size)
        parent = cache.new_sequence()
        if P > 1:
            target.step(cache, [parent], [prompt[:-1]])
        for s in range(0, n, chunk):
            xs = x[s:s + chunk]  # (b, T)
            seqs = [cache.fork(parent) for _ in range(len(xs))]
            logits = target.step(cache, seqs, fed[s:s + chunk].tolist(), all_logits=True)  # (b, T, V)
            for q in seqs:
                cache.free(q)
            probs = logits_to_probs(logits, params).cpu()  # (b, T, V): p_1..p_T
            impossible += int((probs.gather(-1, xs.unsqueeze(-1)) == 0).sum())
            U = torch.from_numpy(rng.random(tuple(xs.shape)))  # (b, T)
            for o in orders:
                us[o].append(pit(probs, xs, U, o).numpy())
            if head:
                heads.append(head_rows(probs, head))
        cache.free(parent)
    rows = tuple(np.concatenate([h[i] for h in heads], axis=0) for i in (0, 1)) if head else None
    return {o: np.concatenate(v, axis=0) for o, v in us.items()}, impossible, rows


# ---------------------------------------------------------------------------
# the harness
# ---------------------------------------------------------------------------

@dataclass
class EquivalenceReport:
    settings: dict
    mode: str  # "pit" (temperature > 0) or "greedy" (token-for-token equality with target greedy)
    passed: bool  # the verdict on the samples under test
    speculative: RunStats | None = None  # the samples under test (speculative, or the engine's)
    reference: RunStats | None = None  # target-only calibration; None when skipped or greedy
    u: dict | None = None  # token order -> (n_total, T) PIT values of the samples under test (for plots)
    u_reference: dict | None = None
    impossible: int = 0  # tested tokens to which the target gives probability 0
    impossible_reference: int = 0
    power: Power | None = None  # what this run could have detected (None: not computed)
    head: tuple | None = None  # the tested rows' head probabilities and F_id (power.head_rows) the power used
    sequential: dict = field(default_factory=dict)  # the early-stop looks: count, level, whether one stopped the run
    speed: dict = field(default_factory=dict)
    speculation: dict = field(default_factory=dict)  # acceptance figures of a minispec speculative run
    greedy_mismatches: list = field(default_factory=list)  # greedy mode: (prompt index, first differing position)
    notes: list[str] = field(default_factory=list)
    samples: SampleSet | None = None  # what was tested (for --save-samples)

    @property
    def calibrated(self) -> bool | None:
        """Did the target-only reference pass (None: not run)? A failing reference means the harness is off."""
        return None if self.reference is None else self.reference.passed

    @property
    def verdict(self) -> str:
        """"passed; would have caught a bias of TV >= x ..." or "failed" (with the power figure when computed)."""
        parts = ["passed" if self.passed else "failed"] + ([self.power.phrase()] if self.power is not None else [])
        drafted, accepted = self.drafts
        if drafted == 0:
            parts.append("no tokens were drafted, so the run tested plain sampling, not speculation")
        elif drafted is not None and not self.speculation:  # an engine's own report (minispec's has its own line)
            parts.append(f"the engine reported {drafted} draft tokens, {accepted} accepted")
        return "; ".join(parts)

    @property
    def drafts(self) -> tuple[int | None, int | None]:
        """The draft tokens proposed and accepted, as the engine reported them (None: it tells nothing)."""
        spec = self.speculation or self.settings.get("engine_settings", {}).get("speculation")
        if not isinstance(spec, dict):
            return None, None
        return spec.get("drafted"), spec.get("accepted")

    def to_dict(self) -> dict:
        drafted, accepted = self.drafts
        d = {"passed": self.passed, "verdict": self.verdict, "mode": self.mode, "calibrated": self.calibrated,
             "drafted": drafted, "accepted": accepted, "settings": self.settings, "speed": self.speed,
             "speculation": self.speculation, "notes": self.notes}
        if self.mode == "pit":
            d["speculative"] = self.speculative.to_dict()
            d["reference"] = None if self.reference is None else self.reference.to_dict()
            d["impossible_tokens"] = {"speculative": self.impossible, "reference": self.impossible_reference}
            d["power"] = None if self.power is None else self.power.to_dict()
            d["sequential"] = self.sequential
        else:
            d["greedy_mismatches"] = [{"prompt": j, "position": i + 1} for j, i in self.greedy_mismatches]
        return d

    def format(self) -> str:
        """A readable report: settings, the per-position table (tested beside target-only), verdict, speed."""
        s = self.settings
        per_prompt = f"{s['samples']} per prompt" if s.get("samples") else "per prompt as in the file"
        lines = [f"equivalence: {s['under_test']} against target {s['target']}",
                 f"  {s['samples_total']} sample(s) ({per_prompt}) x {s['tokens']} tokens, {s['prompts']} prompt(s); "
                 f"temperature={s['temperature']}, top_k={s['top_k']}, top_p={s['top_p']}, seed={s['seed']}",
                 f"  stop tokens disabled during the test: every sample has exactly {s['tokens']} tokens"]
        if self.mode == "greedy":
            lines.append("  temperature 0: the PIT is degenerate (p is one-hot), so the check is token-for-token "
                         "equality with target greedy decoding")
            if self.passed:
                lines.append(f"verdict: PASSED: the greedy tokens equal target greedy tokens for all "
                             f"{s['prompts']} prompt(s)")
            else:
                where = ", ".join(f"prompt {j} from position {i + 1}" for j, i in self.greedy_mismatches)
                lines.append(f"verdict: FAILED: the greedy tokens differ from target greedy ({where})")
        else:
            lines += self._pit_lines()
        sp = self.speculation
        if sp:
            lines.append(f"speculation: acceptance rate {sp['acceptance_rate']:.3f}, "
                         f"{sp['mean_accepted']:.2f} tokens per round per sequence")
        lines.append(self._speed_line())
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _pit_lines(self) -> list[str]:
        s = self.settings
        orders = " and ".join({"id": "token-id order", "prob": "descending-probability order"}[o]
                              for o in s["token_orders"])
        lines = [f"  randomized PIT u = F(x-) + U p(x) in {orders}; per position and pooled ('all'): "
                 f"KS and chi-square ({self.speculative.tests[s['token_orders'][0]][-1].bins} bins); "
                 f"p_holm: Holm-adjusted over {self.speculative.n_tests} tests"]
        lines += ["", self._table(), ""]
        q = self.sequential
        level = f"alpha={self.speculative.alpha:.3g}"
        if q.get("interim_looks"):
            level += f" (of {s['alpha']}: {q['interim_alpha']:.2g} spent on each of {q['interim_looks']} early looks)"
        lines.append(f"verdict: {self.verdict.replace('passed', 'PASSED', 1).replace('failed', 'FAILED', 1)}")
        lines.append(f"  at {level}: smallest Holm-adjusted p = {self.speculative.min_adjusted:.3g}, "
                     f"smallest raw p = {self.speculative.min_raw:.3g}")
        if self.power is not None:
            pw = self.power
            lines.append(f"  power: bias p_eps = (1 - eps) p + eps r at every position; smallest eps rejected in "
                         f"{pw.power:.0%} of {pw.runs} simulated runs of this size: "
                         + ", ".join(f"{k} eps {v['eps']:.3g} (TV {v['tv']:.3g})" if v["eps"] is not None
                                     else f"{k} not reached" for k, v in pw.kinds.items()))
        if q.get("stopped_early"):
            lines.append(f"  stopped early: the first {q['samples_tested']} samples already failed at an early look "
                         "(a clear failure; the rest were not drawn)")
        if self.impossible:
            lines.append(f"  {self.impossible} sampled tokens have target probability 0 (outside top-k/top-p): "
                         "impossible under target-only sampling, short of a rounding near-tie at the cut")
        if self.reference is not None:
            cal = "PASSED" if self.reference.passed else "FAILED: the harness itself is off; do not trust the verdict"
            lines.append(f"calibration (target-only samples, same settings, prompts and counts): {cal} "
                         f"(smallest Holm-adjusted p = {self.reference.min_adjusted:.3g}, "
                         f"smallest raw p = {self.reference.min_raw:.3g})")
        return lines

    def _speed_line(self) -> str:
        v, s = self.speed, self.settings
        parts = []
        if "speculative_samples_per_s" in v:
            parts.append(f"{s['engine']} {v['speculative_samples_per_s']:.1f} samples/s ({v['speculative_s']:.1f} s)")
        if "reference_samples_per_s" in v:
            parts.append(f"target-only {v['reference_samples_per_s']:.1f} samples/s ({v['reference_s']:.1f} s)")
        if "pit_s" in v:
            parts.append(f"target PIT passes {v['pit_s']:.1f} s")
        if "power_s" in v:
            parts.append(f"power simulation {v['power_s']:.1f} s")
        return ("speed: " + "; ".join(parts) + f"; total {v['total_s']:.1f} s "
                f"(up to {s['torch_threads']} torch thread(s))")

    def _table(self) -> str:
        runs = [self.speculative] + ([self.reference] if self.reference is not None else [])
        orders = list(self.speculative.tests)
        sub = "/".join(orders)
        cell = f"{'KS p (' + sub + ')':<20}{'chi2 p (' + sub + ')':<20}{'p_holm':<10}"
        width = len(cell)
        out = [f"{'':<9}" + "".join(f"| {r.label:<{width}}" for r in runs),
               f"{'position':<9}" + f"| {cell}" * len(runs)]
        for i, where in enumerate(self.speculative.row_names):
            line = f"{where:<9}"
            for r in runs:
                ks = "/".join(f"{r.tests[o][i].ks_p:.2g}" for o in orders)
                chi = "/".join(f"{r.tests[o][i].chi2_p:.2g}" for o in orders)
                adj = r.row_min_adjusted(i)
                line += f"| {ks:<20}{chi:<20}{adj:<8.3g}{' *' if adj <= r.alpha else '  '}"
            out.append(line.rstrip())
        out.append("(* = rejected at alpha after Holm's correction)")
        return "\n".join(out)


# ---------------------------------------------------------------------------
# input checks
# ---------------------------------------------------------------------------

def _check_test_settings(seed, alpha, bins, orders, batch_size, power_runs) -> tuple:
    """The settings of the test itself (not of the sampling); returns the orders as a tuple."""
    for name, v, lo in (("seed", seed, 0), ("bins", bins, 2), ("batch_size", batch_size, 1),
                        ("power_runs", power_runs, 0)):
        check_int(name, v, lo, error=EquivalenceInputError)
    if not (is_number(alpha) and 0 < alpha < 1):
        raise EquivalenceInputError(f"alpha must be in (0, 1), got {alpha!r}")
    orders = tuple(orders)
    if not orders or any(o not in ORDERS for o in orders) or len(set(orders)) != len(orders):
        raise EquivalenceInputError(f"orders must be a non-empty selection of {', '.join(ORDERS)}; got {orders!r}")
    return orders


def _check_draft(target, draft, engine: str, hf_dirs: dict | None, tree=None) -> None:
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}; got {engine!r}")
    if engine != "minispec":
        need = ["target"] + (["draft"] if engine == "transformers-assisted" else [])
        if not hf_dirs or any(not hf_dirs.get(n) for n in need):
            raise ValueError(f"engine {engine!r} loads the pair with transformers: give hf_dirs with "
                             f"{' and '.join(repr(n) for n in need)} (Hugging Face directories; engines.exported "
                             "makes them from minispec checkpoints)")
        return
    # speculate's checks of the draft: its kind, its vocabulary and tokenizer, and that it drafts the tree if given
    check_tree_drafter(make_drafter(target, draft), tree)


def _check_inputs(target, draft, prompts, samples, tokens, k, temperature, top_k, top_p, sampler, engine, hf_dirs,
                  tree=None):
    """Validate the sampling side before any sampling; returns (SamplingParams, prompt batch, tree)."""
    try:
        get_sampler(sampler)
        check_int("samples", samples, MIN_SAMPLES)
        check_int("tokens", tokens, 1)
        if tree is not None:
            if engine != "minispec":
                raise ValueError(f"tree is minispec's token tree; engine {engine} drafts chains")
            tree = tree if tree == "auto" or isinstance(tree, DynamicTree) else check_tree(tree)
        elif k != "auto" and not isinstance(k, AdaptiveK):
            check_int("k", k, 1)
        params = SamplingParams(temperature, top_k, top_p)
        _check_draft(target, draft, engine, hf_dirs, tree)
        batch, _ = normalize_prompts(target, prompts)
    except ValueError as e:  # the checks above already say what to do
        raise EquivalenceInputError(str(e)) from None
    check_window(target, batch, tokens)
    return params, batch, tree


def check_window(target, prompts: list[list[int]], tokens: int) -> None:
    """Every prompt and its new tokens fit the target's window (it scores them all), or EquivalenceInputError:
    checked before any engine starts."""
    for j, p in enumerate(prompts):
        if len(p) + tokens > target.config.max_seq_len:
            raise EquivalenceInputError(f"prompt {j} ({len(p)} tokens) + {tokens} new tokens exceeds the target's "
                                        f"max_seq_len={target.config.max_seq_len}; use a shorter prompt or fewer "
                                        "tokens")


# ---------------------------------------------------------------------------
# the harness
# ---------------------------------------------------------------------------

def max_threads() -> int:
    """The CPU threads a step may use: MINISPEC_THREADS when set, else the caller's count (the tuner picks
    per step within it)."""
    from minispec.threads import ceiling
    return ceiling()


def run_equivalence(target, draft, prompts, samples: int = DEFAULTS["samples"], tokens: int = DEFAULTS["tokens"],
                    k: int | str | AdaptiveK = DEFAULTS["k"], temperature: float = DEFAULTS["temperature"],
                    top_k: int | None = DEFAULTS["top_k"], top_p: float | None = DEFAULTS["top_p"], seed: int = 0,
                    sampler: str = "exact", alpha: float = DEFAULTS["alpha"], bins: int = DEFAULTS["bins"],
                    orders=ORDERS, reference: bool = True, batch_size: int = DEFAULTS["batch_size"],
                    progress: bool = False, names: dict | None = None, engine: str = "minispec",
                    hf_dirs: dict | None = None, power_runs: int = DEFAULTS["power_runs"],
                    tree: tuple[int, ...] | DynamicTree | str | None = None) -> EquivalenceReport:
    """Test that an engine's speculative (or plain) samples follow the target's distribution.

    target: a Transformer (it scores every sample); draft: what speculate drafts with (a Transformer sharing its
    tokenizer and vocabulary, "prompt-lookup" or a Drafter; engine "minispec"; unused by the transformers engines).
    prompts: token ids, one prompt (list[int]) or several (list[list[int]]); `samples` continuations
    of `tokens` tokens are drawn per prompt, sample g (prompt-major) with the generator seeded seed + g.
    temperature, top_k, top_p, k, sampler: the sampling settings (k an integer, "auto" or an AdaptiveK;
    sampler "exact" or a broken negative control of minispec.controls).
    engine: "minispec" (target.speculate), "transformers" (plain transformers sampling) or
    "transformers-assisted" (transformers' assisted generation); the transformers engines load the pair from
    hf_dirs {"target": DIR, "draft": DIR} (Hugging Face directories: see engines.exported).
    alpha: the significance level of the verdict (Holm-corrected); bins: chi-square histogram bins;
    orders: the token orders the PIT runs in ("id", "prob"; all their tests join one Holm family).
    reference: also test target-only samples (the calibration reference).
    batch_size: samples per sampling call, and per early-stop look. power_runs: simulated runs per eps for the
    power figure (0: no power figure). names: labels for target/draft in the report.
    tree: engine "minispec" only: speculate with this token tree (b_1, ..., b_d), a DynamicTree or "auto" instead of k.
    Temperature 0 checks token-for-token equality with target greedy decoding instead of the PIT.
    Raises EquivalenceInputError (a ValueError) on bad input, before any sampling.
    """
    params, batch, tree = _check_inputs(target, draft, prompts, samples, tokens, k, temperature, top_k, top_p,
                                        sampler, engine, hf_dirs, tree)
    orders = _check_test_settings(seed, alpha, bins, orders, batch_size, power_runs)
    names = names or {}
    settings = {"target": names.get("target", "(model)"), "engine": engine, "seed": seed}
    file_settings = {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
                     "new_tokens": tokens}
    notes = []
    counts = [1 if params.greedy else samples] * len(batch)
    stats: dict = {}
    bar = _progress_bar(sum(counts), "speculative" if engine == "minispec" else engine, progress and not params.greedy)
    if engine == "minispec":
        notes += _describe_minispec(settings, file_settings, draft, k, tree, sampler, seed, params, names)
        chunks = _minispec_chunks(target, draft, batch, counts, tokens, params, k, sampler, seed, batch_size, stats,
                                  bar, tree)
    else:
        eng = TransformersEngine(engine, hf_dirs, target, batch[0], params, tokens, k)
        _describe_transformers(settings, file_settings, eng.info, hf_dirs, k, seed, names)
        chunks = eng.chunks(batch, counts, seed, batch_size, bar)
    t_start = time.perf_counter()
    report = _verdict(target, chunks, batch, counts, params, tokens, settings, file_settings, notes, seed, alpha,
                      bins, orders, reference, batch_size, progress, power_runs, interim=True, t_start=t_start)
    _speculation(report, stats)
    return report


def _describe_minispec(settings: dict, file_settings: dict, draft, k, tree, sampler: str, seed: int,
                       params: SamplingParams, names: dict) -> list[str]:
    """What the report and the samples' settings line say of a minispec run; returns the negative control's notes."""
    draft_name = names.get("draft", draft if isinstance(draft, str) else "(model)")
    k_name = None if tree is not None else k if isinstance(k, (int, str)) else f"AdaptiveK(k_max={k.k_max})"
    tree_name = None if tree is None else tree if isinstance(tree, str) else str(tree) if isinstance(
        tree, DynamicTree) else list(tree)
    how = f"k={k_name}" if tree is None else f"tree={tree_text(tree)}"
    settings.update(engine_version=__version__, draft=draft_name, k=k_name, sampler=sampler,
                    under_test=f"speculative (sampler={sampler}, draft={draft_name}, {how})")
    file_settings.update(sampler=sampler, draft=draft_name, k=k_name, seed=seed)
    if tree is not None:
        settings["tree"] = file_settings["tree"] = tree_name
    return _control_notes(sampler, draft, params, tree)


def _describe_transformers(settings: dict, file_settings: dict, info: dict, hf_dirs: dict, k, seed: int,
                           names: dict) -> None:
    """What the report and the samples' settings line say of a transformers run (`info`: the engine's own)."""
    assisted = info.get("assistant")
    how = (f"assisted generation, assistant {names.get('draft', hf_dirs['draft'])}, num_assistant_tokens="
           f"{assisted['num_assistant_tokens']}" if assisted else "sampling")
    settings.update(info, draft=names.get("draft", hf_dirs.get("draft")) if assisted else None,
                    k=k if assisted else None, sampler=None, under_test=f"transformers {info['engine_version']} {how}")
    file_settings.update(seed=seed, **({"assistant": assisted} if assisted else {}))


def _speculation(report: EquivalenceReport, stats: dict) -> None:
    """A minispec run's draft counts into the report, with a note where nothing was drafted."""
    if stats.get("drafted") is not None:
        d = stats["drafted"]
        report.speculation = {"acceptance_rate": stats["accepted"] / d if d else 0.0,
                              "mean_accepted": stats["committed"] / stats["sequence_rounds"]
                              if stats["sequence_rounds"] else 0.0, "drafted": d, "accepted": stats["accepted"]}
        if d == 0:
            report.notes.append("the drafter proposed no tokens, so no draft was ever verified: the test says "
                                "nothing about the acceptance rule (prompt lookup needs repeated n-grams in the "
                                "context)")


def audit_samples(target, samples: SampleSet | Drawing | str | Path, seed: int = 0, alpha: float = DEFAULTS["alpha"],
                  bins: int = DEFAULTS["bins"], orders=ORDERS, reference: bool = True,
                  batch_size: int = DEFAULTS["batch_size"], progress: bool = False, names: dict | None = None,
                  power_runs: int = DEFAULTS["power_runs"]) -> EquivalenceReport:
    """Test samples drawn by any engine (vLLM, SGLang, llama.cpp, ...) against minispec's target.

    samples: a samples file (JSONL: see minispec.equivalence.samples), a SampleSet, or a server's Drawing
    (minispec.equivalence.drawing), drawn here chunk by chunk with the early-stop looks run_equivalence takes, so
    a clearly broken server stops being sampled at the first look that fails. The PIT runs on the
    target with one batched pass per distinct prompt, in both token orders with Holm's correction, and the
    target-only calibration draws the same counts after the same prompts with the file's settings (seed:
    its generators, as in run_equivalence). Raises EquivalenceInputError (SamplesFileError for the file) on
    a sample the target cannot score, before any scoring.
    """
    orders = _check_test_settings(seed, alpha, bins, orders, batch_size, power_runs)
    cfg = target.config
    if isinstance(samples, Drawing):
        return _audit_drawing(target, samples, seed, alpha, bins, orders, reference, batch_size, progress, names,
                              power_runs)
    if isinstance(samples, SampleSet):
        validate(samples, cfg.vocab_size, cfg.max_seq_len, MIN_SAMPLES)
    else:
        samples = read_samples(samples, cfg.vocab_size, cfg.max_seq_len, MIN_SAMPLES)
    s = samples.settings
    names = names or {}
    version = s["engine_version"]
    extra = {k: v for k, v in s.items() if k not in SETTINGS_KEYS}
    settings = {"target": names.get("target", "(model)"), "engine": s["engine"], "engine_version": version,
                "source": samples.source, "engine_settings": extra, "seed": seed, "draft": None, "k": None,
                "sampler": None,
                "under_test": f"samples from {s['engine']}{' ' + version if version else ''} ({samples.source})"}
    params = samples.params
    t_start = time.perf_counter()
    offsets = np.cumsum([0] + samples.counts)
    chunks = ((p, samples.tokens[offsets[j]:offsets[j + 1]]) for j, p in enumerate(samples.prompts))
    return _verdict(target, chunks, samples.prompts, samples.counts, params, samples.new_tokens, settings, s,
                    _engine_notes(s), seed, alpha, bins, orders, reference, batch_size, progress, power_runs,
                    interim=False, t_start=t_start)


def _audit_drawing(target, drawing: Drawing, seed, alpha, bins, orders, reference, batch_size, progress, names,
                   power_runs) -> EquivalenceReport:
    """audit_samples of a server's samples drawn as they are scored: interim looks as in run_equivalence."""
    cfg, s = target.config, drawing.settings
    where = drawing.endpoint.name
    if drawing.vocab_size > cfg.vocab_size or any(not 0 <= t < cfg.vocab_size for p in drawing.prompts for t in p):
        raise EquivalenceInputError(f"{where}: the prompts or the ids taken from the server reach beyond the "
                                    f"target's vocabulary [0, {cfg.vocab_size})")
    check_window(target, drawing.prompts, s["new_tokens"])
    if sum(drawing.counts) < MIN_SAMPLES:
        raise EquivalenceInputError(f"{sum(drawing.counts)} sample(s) asked for; the test needs at least {MIN_SAMPLES}")
    names = names or {}
    extra = {k: v for k, v in s.items() if k not in SETTINGS_KEYS}
    settings = {"target": names.get("target", "(model)"), "engine": s["engine"], "engine_version": s["engine_version"],
                "source": where, "engine_settings": extra, "seed": seed, "draft": None, "k": None, "sampler": None,
                "under_test": f"samples from {where}"}
    notes: list = []
    report = _verdict(target, drawing.chunks(batch_size), drawing.prompts, drawing.counts, SamplingParams(
        s["temperature"], s["top_k"], s["top_p"]), s["new_tokens"], settings, s, notes, seed, alpha, bins, orders,
        reference, batch_size, progress, power_runs, interim=True, t_start=time.perf_counter())
    if "speculation" in s:  # known once the drawing ended
        extra["speculation"] = s["speculation"]
    report.notes[:0] = _engine_notes(s)
    return report


def _engine_notes(settings: dict) -> list[str]:
    """What the engine's own settings say about what the test covers: a speculative engine that reports no drafted
    tokens sampled from its target alone (a llama-server started without a draft is plain by choice: its verdict
    says no tokens were drafted, with no note)."""
    spec = settings.get("speculation")
    plain_llama = settings.get("engine") == LLAMA_CPP and not settings.get("server_draft")
    if isinstance(spec, dict) and spec.get("drafted") == 0 and not plain_llama:
        return ["the engine reports that it drafted no tokens (its draft model was loaded but never used, or "
                "proposed nothing): its samples came from the target alone, so the test says nothing about its "
                "speculative decoding"]
    return []


def _control_notes(sampler: str, draft, params: SamplingParams, tree=None) -> list[str]:
    """Settings under which a negative control cannot show (the test then says nothing about it)."""
    policy = get_sampler(sampler)
    if not isinstance(policy, Control):
        return []
    if tree is None and policy.trees_only:
        return [f"{sampler} breaks a tree round only: with k (a chain) it is the exact sampler; give a tree"]
    # a tree round takes the sampler's target_probs and tree_verify steps only (its drafts: tree.draw_children)
    cls, exact = type(policy), ExactSampler
    if tree is not None and cls.target_probs is exact.target_probs and cls.tree_verify is exact.tree_verify:
        return [f"{sampler} breaks a step of a chain round that a tree round does not take: with a tree it is the "
                "exact sampler"]
    return policy.silent(draft, params)


def _verdict(target, chunks, prompts, counts, params: SamplingParams, T: int, settings: dict, file_settings: dict,
             notes: list, seed, alpha, bins, orders, reference, batch_size, progress, power_runs, interim: bool,
             t_start: float) -> EquivalenceReport:
    """Score the samples under test (drawn lazily by `chunks`, with early-stop looks when `interim`: the samples
    are drawn here), run the calibration and the power simulation."""
    settings.update(prompts=len(prompts), prompt_lengths=[len(p) for p in prompts],
                    samples=counts[0] if len(set(counts)) == 1 else None, samples_total=sum(counts), tokens=T,
                    temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, alpha=alpha, bins=bins,
                    correction="holm", stop_tokens="disabled", token_orders=list(orders), batch_size=batch_size,
                    torch_threads=max_threads())
    settings.setdefault("engine_version", None)
    notes.append("timings are wall-clock and include whatever else the machine runs; on a shared, loaded machine "
                 "they understate the speed")
    if params.greedy:
        return _greedy(target, chunks, prompts, T, settings, file_settings, notes, t_start)
    looks = _n_chunks(counts, batch_size) - 1 if interim else 0
    a_look, a_final = look_alphas(alpha, looks)  # the early-stop rule (stats.EARLY_ALPHA)
    tested = _score(target, chunks, params, np.random.default_rng([seed, 1]), orders, bins, looks, a_look,
                    HEAD if power_runs else 0)
    drawn = _drawn(settings, file_settings, tested.pairs)
    u = tested.u_all()
    label = "speculative" if settings["engine"] == "minispec" else settings["engine"]
    report = EquivalenceReport(settings, "pit", False, analyse(u, a_look if tested.stopped else a_final, bins, label),
                               u=u, impossible=tested.impossible, notes=notes, samples=drawn)
    report.sequential = {"interim_looks": looks, "interim_alpha": a_look, "final_alpha": a_final,
                         "looks_taken": tested.looks, "stopped_early": tested.stopped,
                         "samples_tested": len(tested.pairs)}
    n = len(tested.pairs)
    if interim:  # drawn here (a file's samples were drawn elsewhere)
        report.speed = {"speculative_s": tested.sample_s, "speculative_samples_per_s": n / tested.sample_s,
                        "speculative_tokens_per_s": n * T / tested.sample_s}
    pit_s = tested.pit_s
    if reference:
        ref = _score(target, _minispec_chunks(target, None, drawn.prompts, drawn.counts, T, params, None, None, seed,
                                              batch_size, {}, _progress_bar(n, "target-only", progress)),
                     params, np.random.default_rng([seed, 2]), orders, bins, 0, 0.0, 0)
        pit_s += ref.pit_s
        report.reference = analyse(ref.u_all(), report.speculative.alpha, bins, "target-only (calibration)")
        report.u_reference, report.impossible_reference = ref.u_all(), ref.impossible
        report.speed.update(reference_s=ref.sample_s, reference_samples_per_s=n / ref.sample_s)
    if power_runs:
        report.head = p_head, f_id = tested.head_all()
        report.power = detectable_bias(p_head, f_id, report.speculative.alpha, bins, orders, runs=power_runs, seed=seed)
        report.speed["power_s"] = report.power.seconds
    report.passed = report.speculative.passed
    report.speed.update(pit_s=pit_s, total_s=time.perf_counter() - t_start)
    return report


def _greedy(target, chunks, prompts, T: int, settings, file_settings, notes, t_start) -> EquivalenceReport:
    """Temperature 0: every sample must equal target greedy decoding after its prompt, token for token."""
    t0 = time.perf_counter()
    pairs = [(p, t) for p, tokens in chunks for t in tokens]
    sample_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    ref = target.generate(prompts, max_new_tokens=T, temperature=0.0, stop_tokens=[])
    ref_s = time.perf_counter() - t1
    index = {tuple(p): j for j, p in enumerate(prompts)}
    mismatches = {}
    for p, t in pairs:
        j = index[tuple(p)]
        if t != ref[j] and j not in mismatches:
            mismatches[j] = next((i for i, (x, y) in enumerate(zip(t, ref[j])) if x != y), min(len(t), len(ref[j])))
    notes.append("temperature 0: greedy decoding is deterministic, so one sample per prompt is drawn (a file's "
                 "samples are each compared); --samples is not used")
    drawn = _drawn(settings, file_settings, pairs)
    report = EquivalenceReport(settings, "greedy", not mismatches, greedy_mismatches=sorted(mismatches.items()),
                               notes=notes, samples=drawn)
    report.speed = {"reference_s": ref_s, "reference_samples_per_s": len(prompts) / ref_s,
                    "total_s": time.perf_counter() - t_start}
    if "source" not in settings:  # drawn here
        report.speed.update(speculative_s=sample_s, speculative_samples_per_s=len(pairs) / sample_s)
    return report


def _drawn(settings: dict, file_settings: dict, pairs) -> SampleSet:
    """What was tested, as the samples file --save-samples writes."""
    head = {**file_settings, "engine": settings["engine"], "engine_version": settings["engine_version"]}
    head = {**{k: head[k] for k in SETTINGS_KEYS}, **{k: v for k, v in head.items() if k not in SETTINGS_KEYS}}
    return group(head, pairs, settings.get("source", settings["engine"]))


def _progress_bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="sample", file=sys.stderr, dynamic_ncols=True)
