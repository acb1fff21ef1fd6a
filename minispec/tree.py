"""Token trees: a tree round's shape, its nodes' layout, and how a draft draws a node's children.

A tree of shape (b_1, ..., b_d) gives every node at depth i - 1 up to b_i children (the root, depth 0, is the last
committed token), so it holds up to b_1 + b_1 b_2 + ... + b_1...b_d draft tokens. A round's tree is three lists
per row: its nodes' tokens in breadth-first order (siblings in the order they were drawn), each node's parent (an
index into the nodes; -1: the root) and the (n, V) distributions they were drawn from, each child's given the
siblings drawn before it (`draw_children`). The walk that verifies it is `speculative.tree_verify`; the tree
round: docs/design.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .adaptive import AdaptiveK, tree_round_cost
from .errors import GenerationError, is_int, show
from .sampling import sample_rows

MAX_TREE_NODES = 256  # draft tokens in one tree: a verify pass scores them all, and the mask grows with their square


def tree_size(shape: tuple[int, ...], width: int | None = None) -> int:
    """Draft tokens in a full tree of this shape: b_1 + b_1 b_2 + ... + b_1 ... b_d; with a width (a DynamicTree's),
    at most that many a depth."""
    return sum(min(math.prod(shape[:i + 1]), width or math.inf) for i in range(len(shape)))


def fitting(shape: tuple[int, ...], room: int, width: int | None = None) -> tuple[int, ...]:
    """The deepest prefix of shape whose full tree has at most `room` nodes (a tree's nodes take cache slots
    past the context, one each, whatever their depth)."""
    d = 0
    while d < len(shape) and tree_size(shape[:d + 1], width) <= room:
        d += 1
    return shape[:d]


@dataclass(frozen=True)
class DynamicTree:
    """A tree whose shape the draft chooses each round, level by level (EAGLE-2's dynamic trees, Li et al. 2024):
    `depth` levels of at most `width` nodes. At each level the width goes to the children most likely to be
    reached (allocate), so a round spends its nodes on second guesses where the draft is unsure and on depth where
    it is sure, which no fixed shape can do for every position. Any node may get up to `width` children.

    Exact like a fixed shape: a node's number of children is fixed before they are drawn, from the draft's own
    distributions and the tokens drawn at shallower levels, never from the children themselves nor from the
    target (tree_verify's induction holds for any number of children decided so)."""

    width: int
    depth: int

    def __post_init__(self):
        if not (is_int(self.width) and is_int(self.depth) and self.width >= 1 and self.depth >= 1):
            raise GenerationError(f"DynamicTree needs width >= 1 and depth >= 1, got width {show(self.width)}, "
                                  f"depth {show(self.depth)}")
        if self.width * self.depth > MAX_TREE_NODES:
            raise GenerationError(f"DynamicTree(width={self.width}, depth={self.depth}) has up to "
                                  f"{self.width * self.depth} nodes, more than {MAX_TREE_NODES}")

    @property
    def caps(self) -> tuple[int, ...]:
        """The children a node may get, per depth (the fixed shape every round's tree fits in)."""
        return (self.width,) * self.depth

    def __str__(self) -> str:
        return f"{self.width}x{self.depth}"


def allocate(values: list[float], dists: torch.Tensor, cap: int, width: int) -> list[int]:
    """Children per node of one level of a DynamicTree: the `width` largest of value_f * m_f,j over the level's
    nodes f and j < cap, where value_f estimates the chance the walk reaches f (the product of the draft's
    probabilities along its path: the draft as its own model of the target) and m_f,j is the j-th largest
    probability of f's distribution dists[f] (the j-th child's share when it is drawn without replacement, exact
    when greedy). A node's count is how many of its terms are among them (a prefix: m_f,j falls with j); a term
    with no probability never counts (the support ran out)."""
    if not values:
        return []
    top = dists.double().topk(min(cap, dists.shape[-1]), dim=-1).values  # (n, cap), each row descending
    gains = torch.tensor(values, dtype=torch.float64).unsqueeze(1) * top
    flat = gains.flatten()
    chosen = flat.topk(min(width, flat.numel())).indices
    counts = [0] * len(values)
    for c in chosen[flat[chosen] > 0].tolist():
        counts[c // top.shape[1]] += 1
    return counts


def check_tree(tree) -> tuple[int, ...]:
    """speculate's `tree`: a non-empty sequence of children counts >= 1, at most MAX_TREE_NODES nodes in all."""
    shape = tuple(tree) if isinstance(tree, (list, tuple)) else None
    if not shape or not all(is_int(b) and b >= 1 for b in shape):
        raise GenerationError(f"tree must be 'auto' or a tuple of children counts per depth (b_1, ..., b_d), each an "
                              f"integer >= 1, got {show(tree)}")
    shape = tuple(int(b) for b in shape)
    if tree_size(shape) > MAX_TREE_NODES:
        raise GenerationError(f"tree {shape} has {tree_size(shape)} nodes, more than {MAX_TREE_NODES}")
    return shape


def parse_tree(text: str) -> tuple[int, ...] | DynamicTree | str:
    """A tree as the command line writes it: "auto", children per depth ("2,2,2"), or a DynamicTree as
    WIDTHxDEPTH ("4x4"); checked as speculate checks it (GenerationError naming the text)."""
    if text == "auto":
        return text
    try:
        if "x" in text:
            width, depth = text.split("x")
            return DynamicTree(int(width), int(depth))
        return check_tree(tuple(int(b) for b in text.split(",")))
    except (ValueError, GenerationError) as e:
        why = "" if type(e) is ValueError else f": {e}"
        raise GenerationError(f"{text!r} is not a tree (children per depth as 2,2,2, WIDTHxDEPTH as 4x4, or auto)"
                              f"{why}") from None


def tree_text(tree) -> str:
    """parse_tree's inverse: "2,2,2", "4x4" or "auto"."""
    return tree if isinstance(tree, str) else str(tree) if isinstance(tree, DynamicTree) else ",".join(map(str, tree))


def chain(n: int) -> list[int]:
    """The parents of a chain of n drafts as a tree's: each draft follows the one before (the first, the root)."""
    return list(range(-1, n - 1))


def depths(parents: list[int]) -> list[int]:
    """Each node's depth (its children's: one more; the root's children: 1)."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def check_tree_proposal(name: str, row: int, shape: tuple[int, ...], tokens: list[int], parents,
                        width: int | None = None) -> list[int]:
    """A drafter's tree for one row, checked: one parent per node, each an earlier node or -1 (the root), nodes in
    breadth-first order, at most b_i children per node at depth i - 1 (and with a width, at most that many nodes
    a depth). Returns the parents as Python ints."""
    par = [int(p) for p in parents] if isinstance(parents, (list, tuple)) else None
    ok = par is not None and len(par) == len(tokens) and all(-1 <= p < j for j, p in enumerate(par))
    if ok:
        dep = depths(par)
        counts: dict[int, int] = {}
        for p in par:
            counts[p] = counts.get(p, 0) + 1
        ok = (dep == sorted(dep) and (not dep or dep[-1] <= len(shape))
              and all(n <= shape[0 if p < 0 else dep[p]] for p, n in counts.items())
              and (width is None or all(dep.count(i) <= width for i in set(dep))))
    if not ok:
        within = f"shape {shape}" + (f" with at most {width} nodes a depth" if width else "")
        raise GenerationError(f"{name} proposed a tree for sequence {row} that is not one of {within}: parents "
                              f"{parents} (one per node, an earlier node or -1, breadth-first, b_i children at most)")
    return par


def draw_children(probs: torch.Tensor, b: int, u: torch.Tensor) -> tuple[list[int], list[torch.Tensor]]:
    """Up to b distinct children of one node, drawn without replacement from probs (V,) with the uniforms u (b,):
    child i is drawn from q_i, probs with children 1..i-1 removed and renormalised, and q_i is what it reports (the
    distribution the walk divides by). Fewer than b when the support runs out (top-k, top-p); u is always spent
    whole, so a row's stream of uniforms does not depend on the support."""
    q = probs.double().clone()
    tokens, qs = [], []
    for i in range(b):
        mass = float(q.sum())
        if mass <= 0:
            break
        qi = q / mass
        t = sample_rows(qi.unsqueeze(0), u[i:i + 1])[0]
        tokens.append(t)
        qs.append(qi)
        q[t] = 0.0
    return tokens, qs


def top_children(logits: torch.Tensor, b: int) -> list[int]:
    """A greedy tree's children of one node: the b most likely tokens of logits (V,) (fewer if fewer are finite)."""
    values, ids = logits.float().topk(min(b, logits.shape[-1]))
    return [int(t) for t, v in zip(ids, values) if v > float("-inf")]


# ---- tree="auto": a shape chosen each round from measured costs, as k="auto" chooses k

# The shapes tree="auto" chooses among: the chains of 1 to 8 drafts and a few trees of at most 16 nodes (wide
# first levels, where the branching pays most, narrowing with depth). () is plain decoding.
AUTO_SHAPES: tuple[tuple[int, ...], ...] = (
    *((1,) * k for k in range(1, 9)),
    (2,), (3,), (4,), (2, 1), (2, 2), (3, 1), (3, 2), (4, 2), (2, 1, 1), (2, 2, 1), (3, 1, 1), (4, 1, 1), (2, 2, 2),
    (3, 2, 1), (2, 1, 1, 1), (2, 2, 1, 1), (3, 1, 1, 1), (2, 1, 1, 1, 1), (2, 1, 1, 1, 1, 1),
)


def expected_tree_tokens(a: float, shape: tuple[int, ...]) -> float:
    """Tokens one round of this shape commits when every child the walk tests is accepted with probability a,
    independently: the walk leaves a node at depth i - 1 with probability s_i = 1 - (1 - a)^b_i (some child of
    its b_i accepted), so 1 + s_1 + s_1 s_2 + ... + s_1 ... s_d. A chain is adaptive.expected_tokens. An
    approximation: a later sibling is tested against a residual, so its acceptance is not the first's."""
    total, reach = 1.0, 1.0
    for b in shape:
        reach *= 1.0 - (1.0 - a) ** b
        total += reach
    return total


def best_tree(a: float, draft_pass: Callable[[int], float], verify: Callable[[int], float],
              shapes=AUTO_SHAPES) -> tuple[int, ...]:
    """The shape with the most tokens per unit of time: expected_tree_tokens(a, shape) / tree_round_cost(shape,
    draft_pass, verify(tree_size(shape))), over `shapes` and () (plain decoding: verify(0)).

    draft_pass(w): a draft pass over w tokens; verify(n): the target's pass over n drafts (n + 1 rows); both in
    one unit (a plain decode step). Ties go to the fewer nodes."""
    def rate(shape):
        return expected_tree_tokens(a, shape) / tree_round_cost(shape, draft_pass, verify(tree_size(shape)))
    return max(((), *shapes), key=lambda sh: (rate(sh), -tree_size(sh)))


def tested_children(parents: list[int], path: list[int]) -> int:
    """The children a tree round's walk tested, from the nodes' parents and the accepted path: at each node of the
    path its rank among its siblings (every earlier sibling was rejected), and at the node where the walk stopped,
    all its children (all rejected; none at a leaf). A chain: the accepted drafts, plus one if one was rejected."""
    children: dict[int, list[int]] = {}
    for j, par in enumerate(parents):
        children.setdefault(par, []).append(j)
    tested, node = 0, -1
    for j in path:
        tested += children[node].index(j) + 1
        node = j
    return tested + len(children.get(node, []))


class AdaptiveTree(AdaptiveK):
    """tree="auto": each round's shape from running estimates of the per-child acceptance and of the step costs.

    The acceptance a is the share of the children tested that were accepted (tested_children): a chain round
    counts as AdaptiveK counts it. Costs: AdaptiveK's, the verify pass keyed by its drafts (a tree's nodes), with
    a draft pass over w tokens priced as one token's times the target's measured verify(w - 1) / verify(0): both
    are the same kind of forward pass on the same machine, and a draft pass's width is not measured alone (a
    round times all its passes together). best_tree picks the shape; plain decoding and its probes as AdaptiveK.
    Exactness does not depend on any of this: a round's shape is fixed before its drafts are drawn.
    """

    def __init__(self, shapes=AUTO_SHAPES, start: tuple[int, ...] = (2, 2), **kw):
        super().__init__(k_max=max(map(len, shapes)), **kw)
        self.shapes, self.start = tuple(tuple(sh) for sh in shapes), tuple(start)

    def _width(self, w: int) -> float:
        """A pass over w tokens relative to one, from the verify costs measured."""
        return self.verify_cost(w - 1) / max(self.verify_cost(0), 1e-12)

    def choose_tree(self) -> tuple[int, ...]:
        """This round's shape (() = a plain decode step, (1,) a probe)."""
        if self.successes + self.failures == 0 or self.draft_step_s is None or not self.verify_s:
            return self.start  # nothing measured yet
        unit = max(self.verify_cost(0), 1e-12)  # a clock too coarse to see a step must not divide by 0
        c = self.draft_step_s / unit
        shape = best_tree(self.acceptance, lambda w: c * self._width(w), lambda n: self.verify_cost(n) / unit,
                          self.shapes)
        return shape or (1,) * self._gate(0)  # plain decoding, or on schedule a one-draft probe

    def update_tree(self, parents: list[list[int]], paths: list[list[int]], draft_s: float,
                    widths: list[int] | None, verify_s: float | None) -> None:
        """One tree round's outcome: per sequence its nodes' parents and accepted path; wall times of drafting (over
        passes of these widths; None: not timed) and of verifying (None: not timed)."""
        d = self.decay
        accepted = sum(map(len, paths))
        self.successes = d * self.successes + accepted
        self.failures = d * self.failures + sum(tested_children(par, path) for par, path in zip(parents, paths)) \
            - accepted
        if widths and self.verify_s:  # a pass's width is priced from the verify costs, so those come first
            step = draft_s / sum(self._width(w) for w in widths)
            self.draft_step_s = step if self.draft_step_s is None else d * self.draft_step_s + (1 - d) * step
        if verify_s is not None:
            n = max(map(len, parents), default=0)
            self.verify_s[n] = verify_s if n not in self.verify_s else d * self.verify_s[n] + (1 - d) * verify_s
