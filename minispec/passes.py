"""One forward pass over the paged KV cache: where its new tokens write and what they read (`AttentionMetadata`,
built by `prepare`), and the token trees of a tree round (`TokenTrees`, `keep_path`).

After nano-vllm, which keeps the block manager (block tables) apart from the pass metadata its model runner
builds. `prepare` and `keep_path` take any cache with `reserve`, `slots`, `lengths`, `trees` and `move_tokens`:
the `cache.PagedKVCache` listed next, which holds a `TokenTrees` beside its block tables so that fork, free and
truncate keep the two in step. A sequence's tokens form a chain, except during a tree round: tokens appended with
parents attend to their ancestors only, at positions by depth, until `keep_path` keeps one root-to-leaf path and
drops the rest. docs/design.md, "The paged KV cache and its invariants" and "A tree round".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where a forward pass reads and writes K/V. Built once per forward, passed to every layer.

    B sequences, each with n_b new tokens, right-padded to T = max n_b."""

    positions: torch.Tensor  # (B, T) absolute position of each new token (padding: 0)
    write_slots: torch.Tensor  # (N,) pool slot of each valid new token, in (b, t) row-major order
    valid: torch.Tensor  # (B, T) bool: which new-token entries are real (not padding)
    read_slots: torch.Tensor  # (B, L) pool slots of each sequence's whole context, L = max context length
    read_range: tuple[int, int] | None  # (first, end): one sequence whose slots are consecutive (read as a view)
    mask: torch.Tensor | None  # (B, 1, T, L) bool: query t may attend key j (causal and within the length);
    # None when every query may attend every key it reads (one new token per sequence, equal lengths)
    # a pass with tree tokens: keys[b][t] = the indices of the keys row t of sequence b attends (its context and
    # its ancestors, in order) for a tree token, None for a chain token; None when the pass has no tree token
    keys: list[list[torch.Tensor | None]] | None = None

    def row_ends(self) -> list[list]:
        """The keys each query row attends, made once a pass: a count n (the first n: a chain token's position + 1;
        0 for padding) or, for a tree token, the indices of its keys (`keys`)."""
        if not hasattr(self, "_row_ends"):
            self._row_ends = torch.where(self.valid, self.positions + 1, 0).tolist()
            for b, row in enumerate(self.keys or []):
                for t, k in enumerate(row):
                    if k is not None:
                        self._row_ends[b][t] = k
        return self._row_ends


class TokenTrees:
    """The tree tokens of each sequence: seq -> {token index: its parent's index}, from the first token appended
    with parents to the sequence's end; a token not listed follows the one before it (a chain). Plain Python."""

    def __init__(self):
        self.parents: dict[int, dict[int, int]] = {}

    def __contains__(self, seq: int) -> bool:
        return seq in self.parents

    def __len__(self) -> int:
        return len(self.parents)

    def note(self, seq: int, start: int, n: int, parents: list[int] | None) -> None:
        """Tokens start..start+n-1 appended to `seq` with these parents (None: each follows the one before): noted
        if they are tree tokens or follow some (a chain appended after a tree's tokens is part of its tail)."""
        if parents is not None or seq in self.parents:
            self.parents.setdefault(seq, {}).update(
                (start + t, start + t - 1 if parents is None else parents[t]) for t in range(n))

    def fork(self, seq: int, child: int) -> None:
        if seq in self.parents:
            self.parents[child] = dict(self.parents[seq])

    def drop(self, seq: int) -> None:
        """`seq` is freed, or a chain again."""
        self.parents.pop(seq, None)

    def truncate(self, seq: int, new_len: int) -> None:
        par = self.parents.get(seq)
        if par is not None:
            for i in [i for i in par if i >= new_len]:
                del par[i]
            if not par:
                del self.parents[seq]

    def ancestry(self, seq: int, i: int) -> tuple[int, list[int]]:
        """The tokens token i of `seq` attends, as (n, tail): tokens 0..n-1 (its chain of ancestors) then the tree
        tokens `tail` (its ancestors after them and itself, root first). Its position is n + len(tail) - 1."""
        par, tail = self.parents.get(seq, {}), []
        while i in par:
            tail.append(i)
            i = par[i]
        return i + 1, tail[::-1]

    def path_moves(self, seq: int, start: int, keep: list[int], length: int) -> list[tuple[int, int]]:
        """The (from, to) token moves that `keep_path(cache, seq, start, keep)` makes, after checking that `keep`
        is a path: ascending indices from `start` on, each one's parent the one before (the first's: token
        start - 1), with every token before `start` in a chain. `length`: the sequence's."""
        par = self.parents.get(seq, {})
        if not 1 <= start <= length or any(par.get(i, i - 1) != i - 1 for i in range(start)):
            raise ValueError(f"keep_path: tokens before {start} of sequence {seq} (length {length}) must be a chain")
        for before, i in zip([start - 1, *keep], keep):
            if not before < i < length or par.get(i, i - 1) != before:
                raise ValueError(f"keep_path: {keep} is not a path from token {start - 1} of sequence {seq}")
        return [(i, start + j) for j, i in enumerate(keep) if i != start + j]

    def check(self, lengths: dict[int, int]) -> None:
        """Assert that every tree's parents are earlier tokens and its tail runs whole to the sequence's end."""
        for s, par in self.parents.items():
            assert par and all(-1 <= p < i < lengths[s] for i, p in par.items()), f"sequence {s}: bad parents"
            assert set(par) == set(range(min(par), lengths[s])), f"sequence {s}: a tree's tail is not whole"


def keep_path(cache, seq: int, start: int, keep: list[int]) -> None:
    """A tree round's end: the tokens of `seq` at indices `keep` (a path, see TokenTrees.path_moves) become tokens
    start, start + 1, ... with their K/V (computed at the positions they now have), and every other token from
    `start` on is dropped. The sequence is a chain again."""
    moves = cache.trees.path_moves(seq, start, keep, cache.length(seq))  # checked before anything changes
    cache.move_tokens(seq, moves, start, start + len(keep))
    cache.trees.drop(seq)
    cache.truncate(seq, start + len(keep))


def prepare(cache, seqs: list[int], n_new: list[int], parents: list[list[int] | None] | None = None
            ) -> AttentionMetadata:
    """Reserve room in `cache` for the new tokens and build the metadata for one forward pass.

    parents[b] (a tree round): for each new token of seqs[b], the index in the sequence of the token it
    follows (an earlier one); None, or no parents at all: each follows the token before it."""
    starts = [cache.lengths[s] for s in seqs]
    rows = [None] * len(seqs) if parents is None else parents
    for s, par, i0, n in zip(seqs, rows, starts, n_new):
        if par is not None and (len(par) != n or any(not (x == i0 + t - 1 or 0 <= x < i0 + t)
                                                     for t, x in enumerate(par))):
            raise ValueError(f"parents of sequence {s}: {n} indices, each of an earlier token; got {par}")
    new_slots = cache.reserve(seqs, n_new)
    for s, par, i0, n in zip(seqs, rows, starts, n_new):
        cache.trees.note(s, i0, n, par)
    ctx = [st + n for st, n in zip(starts, n_new)]  # each sequence's context length after the step
    B, T, L = len(seqs), max(n_new), max(ctx)
    positions = torch.zeros(B, T, dtype=torch.long)
    valid = torch.zeros(B, T, dtype=torch.bool)
    read = torch.zeros(B, L, dtype=torch.long)
    for b, s in enumerate(seqs):
        positions[b, :n_new[b]] = torch.arange(starts[b], ctx[b])
        valid[b, :n_new[b]] = True
        read[b, :ctx[b]] = torch.tensor(cache.slots(s), dtype=torch.long)
    write = torch.tensor([x for sl in new_slots for x in sl], dtype=torch.long)
    keys = _tree_keys(cache.trees, seqs, starts, n_new, positions)
    mask = _mask(positions, valid, ctx, keys) if T > 1 or min(ctx) < L or keys else None
    read_range = None
    if B == 1 and int(read[0, -1]) - int(read[0, 0]) == L - 1 and (L == 1 or bool((read[0].diff() == 1).all())):
        read_range = (int(read[0, 0]), int(read[0, 0]) + L)
    dev = cache.device
    if keys is not None:
        keys = [[None if k is None else k.to(dev) for k in row] for row in keys]
    return AttentionMetadata(positions.to(dev), write.to(dev), valid.to(dev), read.to(dev), read_range,
                             None if mask is None else mask.to(dev), keys)


def _tree_keys(trees: TokenTrees, seqs: list[int], starts: list[int], n_new: list[int],
               positions: torch.Tensor) -> list[list[torch.Tensor | None]] | None:
    """AttentionMetadata.keys of a pass (None without a tree token); a tree token's position becomes its depth's
    (positions is updated in place)."""
    if not any(s in trees for s in seqs):
        return None
    keys: list[list[torch.Tensor | None]] = [[None] * positions.shape[1] for _ in seqs]
    for b, s in enumerate(seqs):
        if s not in trees:
            continue
        for t in range(n_new[b]):  # a tree token sits at the position of its depth and attends its ancestors only
            n, tail = trees.ancestry(s, starts[b] + t)
            if tail != list(range(n, n + len(tail))):  # (else its ancestors are the tokens before it: a chain)
                keys[b][t] = torch.cat((torch.arange(n), torch.tensor(tail, dtype=torch.long)))
                positions[b, t] = n + len(tail) - 1
    return keys


def _mask(positions: torch.Tensor, valid: torch.Tensor, ctx: list[int], keys) -> torch.Tensor:
    """The (B, 1, T, L) bool mask of a pass: causal, each tree token to its own keys, padding queries to key 0."""
    (B, T), L = positions.shape, max(ctx)
    key_pos = torch.arange(L)
    # key j is visible to the query at absolute position p iff j <= p (the context is causal)
    mask = key_pos.view(1, 1, 1, L) <= positions.view(B, 1, T, 1)
    for b, row in enumerate(keys or []):
        for t, k in enumerate(row):
            if k is not None:
                mask[b, 0, t] = False
                mask[b, 0, t, k] = True
    # padding queries see key 0 only, so softmax stays finite; their outputs are discarded
    return mask | (~valid).view(B, 1, T, 1) & (key_pos == 0).view(1, 1, 1, L)
