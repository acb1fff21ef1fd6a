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
  softmax (temperature 1, no top-k / top-p) to the acceptance step. This is
  transformers' candidate generators (DFlash, MTP) after assisted generation was
  fixed (huggingface/transformers issue #47932): drawn from the processor-applied
  logits, returned as raw logits, so the ratio p/q is inflated wherever top-k or
  top-p cut q's support;
- "greedy-draft": a model draft proposes its argmax but reports its processed
  softmax as q, so the acceptance step divides by a q the token was not drawn
  from. This is the bug transformers 4.41-4.44 shipped for assisted generation
  with do_sample=True (huggingface/transformers issue #32867, fixed by PR #33534):
  the draft's argmax is accepted with probability min(1, p/q) and every other
  token can only come from the residual, so the output leans toward the draft's
  favourite token whenever the draft is not one-hot;
- "target-at-t1": the acceptance step and the residual use the target's raw softmax
  (temperature 1, no top-k / top-p) while the draft sampled with the request's
  settings: vLLM before 0.6.4 (vllm-project/vllm issue #9834, fixed by PR #10198
  "apply sampling parameters to target probabilities"). Here the bonus token comes
  from the same unprocessed p;
- "residual-drafted-only": after a rejection the residual max(0, p - q) subtracts q
  at the drafted token only, leaving p elsewhere: xLLM's rejection sampler before
  xLLM-AI/xllm PR #2175 (its "(p - q)+ residual only subtracts draft mass at the
  single drafted token, not the full draft distribution");
- "argmax": the target's draws (the token after a rejection, the bonus token) take
  the most likely token of the distribution they should sample: mistral.rs's
  `sample_speculative_top_kp_min_p`, which filtered the distribution and returned its
  argmax (EricLBuehler/mistral.rs PR #2424, "make speculative sampling actually
  sample");
- "one-hot-q": a model draft samples its token from q but reports a deterministic
  proposer's q, one-hot on its argmax, and a token the reported q gives no mass is
  rejected (as vLLM's kernel does with `draft_prob > 0`): sampled drafts handed to a
  verifier that assumes greedy drafting, the class vLLM PR #41044 fixed for MTP
  drafts (`draft_probs=None` with non-greedy draft sampling). One-hot on the token
  actually drafted is exact, not a bug: accepting with p(x) and resampling from p
  without x gives p for any proposal (tests/test_speculative_mc.py checks it); it
  only lowers the acceptance, which is what that PR's speedup recovered.
- "tree-independent" (tree rounds only): each sibling of a tree node is tested against
  the target's p at that node instead of the residual left by the siblings rejected
  before it (and when all fail, the next token comes from the residual of p and the
  last sibling's q): a multi-draft verifier that treats siblings as independent chains.

At temperature 0 only "always-accept" differs from exact: with one-hot p and q
the residual is p, and a one-hot draw reports the same q either way (and a
greedy draft is already what "greedy-draft" makes of every draft). Where a
control cannot show at all, `Control.silent` says why."""

from __future__ import annotations

import torch

from .drafters import PromptLookupDrafter
from .sampling import SamplingParams, sample_rows
from .speculative import SAMPLERS, ExactSampler, residual


class Control(ExactSampler):
    """A negative control: ExactSampler with one step broken."""

    trees_only = False  # True where the broken step is one only a tree round takes

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
    """A control that needs a model draft's q (breaking its draw or how q is used): prompt lookup's q is one-hot
    whatever the settings."""

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


class TargetAtT1(Control):
    name = "target-at-t1"

    def target_probs(self, logits, params):
        return logits.float().softmax(-1)  # the request's temperature, top-k and top-p never reach the target

    def silent(self, draft, params: SamplingParams) -> list[str]:
        plain = params.temperature == 1 and params.top_k is None and params.top_p is None
        return ["target-at-t1 has no effect here: at temperature 1 without top-k/top-p the processed p is the raw "
                "softmax"] if plain else []


class ResidualDraftedOnly(BrokenDraw):
    name = "residual-drafted-only"

    def verify(self, draft_tokens, q, p, uniforms):
        n, nxt = super().verify(draft_tokens, q, p, uniforms)
        if n < len(draft_tokens):  # rejected at position n: subtract q at the drafted token only
            d, r = draft_tokens[n], p[n].double().clone()
            r[d] = max(0.0, float(p[n, d]) - float(q[n, d]))
            nxt = sample_rows((r / r.sum()).unsqueeze(0), uniforms[len(draft_tokens):])[0]
        return n, nxt


class ArgMax(Control):
    name = "argmax"

    def verify(self, draft_tokens, q, p, uniforms):
        n, _ = super().verify(draft_tokens, q, p, uniforms)
        dist = residual(p[n], q[n]) if n < len(draft_tokens) else p[n]
        return n, int(dist.argmax())  # the distribution built, then its most likely token instead of a draw


class OneHotQ(BrokenDraw):
    name = "one-hot-q"

    def draw(self, logits, probs, u):
        tokens, _ = super().draw(logits, probs, u)
        return tokens, torch.zeros_like(probs).scatter_(-1, probs.argmax(-1, keepdim=True), 1.0)

    def verify(self, draft_tokens, q, p, uniforms):
        k = len(draft_tokens)
        for i, d in enumerate(draft_tokens):
            if float(q[i, d]) > 0 and float(uniforms[i]) < float(p[i, d]) / float(q[i, d]):
                continue
            return i, sample_rows(residual(p[i], q[i]).unsqueeze(0), uniforms[k:])[0]
        return k, sample_rows(p[k].unsqueeze(0), uniforms[k:])[0]


class TreeIndependent(Control):
    name = "tree-independent"
    trees_only = True  # a chain round has no siblings: on chains this sampler is the exact one

    def tree_verify(self, draft_tokens, parents, q, p, uniforms):
        return super().tree_verify(draft_tokens, parents, q, p, uniforms, siblings_see_residual=False)


def register(*samplers: ExactSampler) -> None:
    for s in samplers:
        SAMPLERS[s.name] = s


register(NoResidual(), AlwaysAccept(), UnprocessedQ(), GreedyDraft(), TargetAtT1(), ResidualDraftedOnly(), ArgMax(),
         OneHotQ(), TreeIndependent())
# the names, in that order: CONTROLS break chain rounds (what the harness drives), TREE_CONTROLS tree rounds only
CONTROLS = tuple(n for n, s in SAMPLERS.items() if isinstance(s, Control) and not s.trees_only)
TREE_CONTROLS = tuple(n for n, s in SAMPLERS.items() if isinstance(s, Control) and s.trees_only)
