"""What each speculative round drafts: a schedule chooses a round's plan before anything is drafted and observes
the round's outcome after it.

Five schedules behind one `choose()` / `observe()` pair: `FixedChain` (k drafts a round), `FixedTree` (a shape,
or a `tree.DynamicTree` whose shape the draft fills in), `AdaptiveChain` (an `adaptive.AdaptiveK`: k="auto" and
its like) and `AutoTree` (a `tree.AdaptiveTree`: tree="auto"). `make_schedule` turns speculate's `k` and `tree`
into one. A plan depends only on earlier rounds, so no schedule can bias the output (docs/design.md, "Choosing k").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .adaptive import AUTO_FIXED, AdaptiveK, auto_k, fixed_cost_ratio
from .errors import GenerationError, is_int, show
from .sampling import SamplingParams
from .tree import AdaptiveTree, DynamicTree, check_tree

K_UNSET = object()  # speculate's k when the caller gave none: 4, unless a tree is given


@dataclass(frozen=True)
class Plan:
    """One round's plan, fixed before its drafts are drawn."""

    k: int  # drafts deep: a chain's length or a tree's depth (0: a plain decode step); what stats.k_chosen records
    tree: tuple[int, ...] | DynamicTree | None = None  # a tree round's shape; None: a chain round
    shape: tuple[int, ...] | DynamicTree | None = None  # what stats.tree_chosen records (None: nothing)


@dataclass
class Outcome:
    """What a schedule learns from a round."""

    plan: Plan
    parents: list[list[int]]  # per row: each draft's parent (-1: the root); a chain's are [-1, 0, 1, ...]
    paths: list[list[int]]  # per row: the accepted drafts, root to leaf
    draft_s: float  # wall time of the round's drafting
    verify_s: float  # wall time of its verify pass, acceptance step and commit
    draft_steps: int  # the draft forward passes the round ran
    timed: bool  # False for a call's first round: it also prefilled both models, so its outcome counts, its times not


class Schedule:
    """What each round drafts: choose() before the round, observe() after it (a fixed schedule learns nothing)."""

    def choose(self) -> Plan:
        raise NotImplementedError

    def observe(self, outcome: Outcome) -> None:
        pass


class FixedChain(Schedule):
    def __init__(self, k: int):
        self.k = k

    def choose(self) -> Plan:
        return Plan(self.k)


class FixedTree(Schedule):
    """A fixed shape (b_1, ..., b_d), or a DynamicTree (its caps bound every round's tree)."""

    def __init__(self, tree: tuple[int, ...] | DynamicTree):
        self.tree = tree

    def choose(self) -> Plan:
        return Plan(len(getattr(self.tree, "caps", self.tree)), self.tree, self.tree)


class AdaptiveChain(Schedule):
    """An AdaptiveK: each round's k from its running estimates, fed each round's outcome."""

    def __init__(self, estimator: AdaptiveK):
        self.estimator = estimator

    def choose(self) -> Plan:
        return Plan(self.estimator.choose())

    def observe(self, o: Outcome) -> None:
        self.estimator.update([len(p) for p in o.parents], [len(p) for p in o.paths], o.draft_s,
                              o.draft_steps * o.timed, o.verify_s if o.timed else None)


class AutoTree(AdaptiveChain):
    """An AdaptiveTree: each round a shape; one with a node of several children runs as a tree round, a chain
    (or plain decoding) as a chain round, and the estimator counts it as AdaptiveK does."""

    estimator: AdaptiveTree

    def choose(self) -> Plan:
        shape = self.estimator.choose_tree()
        return Plan(len(shape), shape if any(b > 1 for b in shape) else None, shape)

    def observe(self, o: Outcome) -> None:
        if o.plan.tree is None:
            return super().observe(o)
        widths = [math.prod(o.plan.tree[:i]) for i in range(o.draft_steps)] if o.timed else None
        self.estimator.update_tree(o.parents, o.paths, o.draft_s, widths, o.verify_s if o.timed else None)


def check_plan(k, tree) -> tuple:
    """speculate's k and tree checked, before any work: (k, None) for chains (k 4 when not given), (None, tree)."""
    if tree is not None:
        if k is not K_UNSET:
            raise GenerationError("give k (a chain of drafts) or tree (a tree of them), not both")
        return None, tree if tree == "auto" or isinstance(tree, (AdaptiveTree, DynamicTree)) else check_tree(tree)
    k = 4 if k is K_UNSET else k
    if not (k in ("auto", AUTO_FIXED) if isinstance(k, str) else isinstance(k, AdaptiveK) or (is_int(k) and k >= 1)):
        raise GenerationError(f"k (draft tokens per round) must be an integer >= 1, 'auto', '{AUTO_FIXED}' or an "
                              f"AdaptiveK, got {show(k)}")
    return k, None


def make_schedule(k, tree, target, draft, drafter, params: SamplingParams, batch_size: int, sampler: str) -> Schedule:
    """The schedule of a checked (k, tree) (check_plan). k="auto" and tree="auto" carry their estimators over from
    earlier calls with the same target, draft, settings, batch size and sampler (adaptive.auto_k); "auto-fixed"
    is a fresh AdaptiveK priced from the configs alone (fixed_cost_ratio), so a seed always gives the same tokens."""
    if isinstance(tree, str):  # "auto"
        tree = auto_k(target, draft, params, batch_size, sampler, make=AdaptiveTree)
    if isinstance(tree, AdaptiveTree):
        return AutoTree(tree)
    if tree is not None:
        return FixedTree(tree)
    if k == "auto":
        k = auto_k(target, draft, params, batch_size, sampler)
    elif k == AUTO_FIXED:
        k = AdaptiveK(cost_ratio=fixed_cost_ratio(target, drafter))
    return AdaptiveChain(k) if isinstance(k, AdaptiveK) else FixedChain(k)
