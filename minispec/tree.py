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

import torch

from .errors import GenerationError, is_int, show
from .sampling import sample_rows

MAX_TREE_NODES = 256  # draft tokens in one tree: a verify pass scores them all, and the mask grows with their square


def tree_size(shape: tuple[int, ...]) -> int:
    """Draft tokens in a full tree of this shape: b_1 + b_1 b_2 + ... + b_1 ... b_d."""
    return sum(math.prod(shape[:i + 1]) for i in range(len(shape)))


def fitting(shape: tuple[int, ...], room: int) -> tuple[int, ...]:
    """The deepest prefix of shape whose full tree has at most `room` nodes (a tree's nodes take cache slots
    past the context, one each, whatever their depth)."""
    d = 0
    while d < len(shape) and tree_size(shape[:d + 1]) <= room:
        d += 1
    return shape[:d]


def check_tree(tree) -> tuple[int, ...]:
    """speculate's `tree`: a non-empty sequence of children counts >= 1, at most MAX_TREE_NODES nodes in all."""
    shape = tuple(tree) if isinstance(tree, (list, tuple)) else None
    if not shape or not all(is_int(b) and b >= 1 for b in shape):
        raise GenerationError(f"tree must be a tuple of children counts per depth (b_1, ..., b_d), each an integer "
                              f">= 1, got {show(tree)}")
    shape = tuple(int(b) for b in shape)
    if tree_size(shape) > MAX_TREE_NODES:
        raise GenerationError(f"tree {shape} has {tree_size(shape)} nodes, more than {MAX_TREE_NODES}")
    return shape


def depths(parents: list[int]) -> list[int]:
    """Each node's depth (its children's: one more; the root's children: 1)."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def check_tree_proposal(name: str, row: int, shape: tuple[int, ...], tokens: list[int], parents) -> list[int]:
    """A drafter's tree for one row, checked: one parent per node, each an earlier node or -1 (the root), nodes in
    breadth-first order, at most b_i children per node at depth i - 1. Returns the parents as Python ints."""
    par = [int(p) for p in parents] if isinstance(parents, (list, tuple)) else None
    ok = par is not None and len(par) == len(tokens) and all(-1 <= p < j for j, p in enumerate(par))
    if ok:
        dep = depths(par)
        counts: dict[int, int] = {}
        for p in par:
            counts[p] = counts.get(p, 0) + 1
        ok = (dep == sorted(dep) and (not dep or dep[-1] <= len(shape))
              and all(n <= shape[0 if p < 0 else dep[p]] for p, n in counts.items()))
    if not ok:
        raise GenerationError(f"{name} proposed a tree for sequence {row} that is not one of shape {shape}: parents "
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
