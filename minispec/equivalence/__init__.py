"""The distribution-equivalence harness: do a real draft/target pair's speculative samples follow the target?

Modules: `stats` (the PIT, uniformity tests, Holm: pure functions), `harness` (sampling,
scoring, the report: `run_equivalence` for an engine it drives, `audit_samples` for samples
drawn elsewhere), `samples` (the JSONL samples file), `engines` (transformers' sampling and
assisted generation), `power` (the smallest bias a run would have caught) and `plot`; for
servers, `http` (bounded requests), `drafts` (the draft counts they report), `drawing` (samples
drawn from any server), one module per server engine (`llama_server`, `openai`) and
`two_sample` (the audit without weights); `audit` dispatches to the engines. The command line
is `python -m minispec equivalence` (minispec.cli, which hands its arguments to `audit`);
docs/equivalence.md is the user's guide.

Method: the randomized probability integral transform (PIT; Smith 1985, Brockwell
2007). Draw N speculative continuations of T tokens per prompt. For each sample and
position i, p_i = the target's distribution of token i given the prompt and the
sampled tokens before it, from ONE batched target pass over the sampled sequences
(the prompt prefilled once and shared; the pass only appends, so a rollback bug in
the sampler cannot leak into the reference), processed by the same
`logits_to_probs` with the same SamplingParams. With F_i(x-) = the mass p_i puts
on the tokens before x in a fixed token order, and U ~ Uniform(0, 1) from a
seeded stream of its own,

    u_i = F_i(x_i-) + U * p_i(x_i)

is Uniform(0, 1) exactly when x_i ~ p_i, and by the chain rule (Rosenblatt 1952)
u_1..u_T of one sample are then independent. So under exactness each position's
u's, and all of them pooled, are iid uniform. Each set is tested with
Kolmogorov-Smirnov and with a histogram chi-square.

Any token order fixed by the prefix keeps u uniform; the order decides what the
test sees. Token-id order scatters the head of the distribution over the CDF;
descending-probability order puts it first, so an error that moves mass between
head and tail (what a wrong acceptance rule does) accumulates in F instead of
cancelling. On SmolLM2 the KS distance a broken sampler induces is 1.2-1.5x larger
in probability order (about half the samples for the same power); on a tiny random
pair the two are alike. Both run by default, on the same U, and the verdict is
Holm's correction over orders x (T positions + pooled) x 2 tests at level alpha:
a correct sampler fails with probability at most alpha.

Target-only samples (`target.generate`, same settings, same seeds) go through the
same tests as a calibration reference: if they fail, the harness is off, not the
sampler. Temperature 0 is handled apart: p is one-hot, so u is just U and says
nothing; greedy speculation must instead reproduce target greedy decoding token
for token, and that is what the harness checks there. Stop tokens are disabled
during the test (stop_tokens=[]), so every sample has exactly T tokens.
"""

from ..drafters import PROMPT_LOOKUP  # noqa: F401
from .engines import ENGINES, exported  # noqa: F401
from .harness import DEFAULTS, EquivalenceReport, audit_samples, run_equivalence, target_pit  # noqa: F401
from .plot import plot_report  # noqa: F401
from .power import KINDS, Power, detectable_bias  # noqa: F401
from .samples import MIN_SAMPLES, EquivalenceInputError, SampleSet, SamplesFileError, read_samples  # noqa: F401
from .stats import (  # noqa: F401
    EARLY_ALPHA,
    ORDERS,
    TESTS,
    RunStats,
    Uniformity,
    analyse,
    chi2_bins,
    holm,
    pit,
    uniformity,
    uniformity_batch,
)
