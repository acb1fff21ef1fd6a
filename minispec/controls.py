"""Negative controls: deliberately broken samplers that every exactness test must reject.

A statistical test that passes the exact sampler proves little until it is shown
to fail a wrong one. Each control here is `ExactSampler` with exactly one step
replaced by a plausible mistake, registered under its name in
`speculative.SAMPLERS`, so `speculate(..., sampler="no-residual")` runs it
through the same loop as the exact algorithm. This module is the one list of
them (`CONTROLS`: their names); the command line and the tests read the names
from the registry:

- "no-residual": after a rejection, resample from p instead of norm(max(0, p - q))
  (over-weights the tokens the draft already likes);
- "always-accept": accept every draft token (the output is the draft's);
- "unprocessed-q": a model draft samples from its processed q but reports its raw
  softmax (temperature 1, no top-k / top-p) to the acceptance step;
- "greedy-draft": a model draft proposes its argmax but reports its processed
  softmax as q, so the acceptance step divides by a q the token was not drawn
  from. This is the bug transformers 4.41-4.44 shipped for assisted generation
  with do_sample=True (huggingface/transformers issue #32867, fixed by PR #33534):
  the draft's argmax is accepted with probability min(1, p/q) and every other
  token can only come from the residual, so the output leans toward the draft's
  favourite token whenever the draft is not one-hot.

At temperature 0 only "always-accept" differs from exact: with one-hot p and q
the residual is p, and a one-hot draw reports the same q either way (and a
greedy draft is already what "greedy-draft" makes of every draft). Where a
control cannot show at all, `Control.silent` says why."""

from __future__ import annotations

from .drafters import PromptLookupDrafter
from .sampling import SamplingParams, sample_rows
from .speculative import SAMPLERS, ExactSampler


class Control(ExactSampler):
    """A negative control: ExactSampler with one step broken."""

    def silent(self, draft, params: SamplingParams) -> list[str]:
        """Why this control cannot show with this draft and these settings (a test then says nothing about it)."""
        return []


class NoResidual(Control):
    name = "no-residual"

    def verify(self, draft_tokens, q, p, uniforms):
        n, nxt = super().verify(draft_tokens, q, p, uniforms)
        if n < len(draft_tokens):  # rejected at position n: the exact step drew from the residual; draw from p
            nxt = sample_rows(p[n].unsqueeze(0), uniforms[len(draft_tokens):])[0]
        return n, nxt


class AlwaysAccept(Control):
    name = "always-accept"

    def verify(self, draft_tokens, q, p, uniforms):
        k = len(draft_tokens)
        return k, sample_rows(p[k].unsqueeze(0), uniforms[k:])[0]

    def greedy_verify(self, target, h, n_pending, drafts):
        last = [n - 1 + len(d) for n, d in zip(n_pending, drafts)]  # each row's last draft: the bonus position
        return [len(d) for d in drafts], target.logits(h[list(range(len(drafts))), last]).argmax(-1).tolist()


class BrokenDraw(Control):
    """A control that breaks a model draft's draw: prompt lookup's q is one-hot whatever the settings."""

    def silent(self, draft, params: SamplingParams) -> list[str]:
        if isinstance(draft, (str, PromptLookupDrafter)):
            return [f"{self.name} has no effect with prompt-lookup: its q is one-hot whatever the settings"]
        return []


class UnprocessedQ(BrokenDraw):
    name = "unprocessed-q"

    def draw(self, logits, probs, u):
        tokens, _ = super().draw(logits, probs, u)
        return tokens, logits.float().softmax(-1).double().cpu()

    def silent(self, draft, params: SamplingParams) -> list[str]:
        plain = params.temperature == 1 and params.top_k is None and params.top_p is None
        return (["unprocessed-q has no effect here: at temperature 1 without top-k/top-p the processed q is the "
                 "raw softmax"] if plain else []) + super().silent(draft, params)


class GreedyDraft(BrokenDraw):
    name = "greedy-draft"

    def draw(self, logits, probs, u):
        return probs.argmax(-1).tolist(), probs  # proposes the argmax, reports the distribution it did not draw from


def register(*samplers: ExactSampler) -> None:
    for s in samplers:
        SAMPLERS[s.name] = s


register(NoResidual(), AlwaysAccept(), UnprocessedQ(), GreedyDraft())
CONTROLS = tuple(name for name, s in SAMPLERS.items() if isinstance(s, Control))  # the names, in that order
