"""Paged KV cache: a block pool, per-sequence block tables, rollback and fork, token trees.

After vLLM's PagedAttention and nano-vllm's block manager. `BlockAllocator` is plain Python (a free
list and reference counts); `PagedKVCache` owns the tensors: one pool per layer holding K and V side
by side (one write and one gather per layer and step), and each sequence's block table and length.
The pool is fixed (`num_blocks`, or what `memory_bytes` holds) or, given neither, grows on demand by
doubling (up to `max_blocks`). A sequence's tokens form a chain, except during a tree round: tokens appended
with parents (`prepare(..., parents=...)`) attend to their ancestors only, at positions by depth, until
`keep_path` keeps one root-to-leaf path and drops the rest. Slot layout, copy-on-write, rollback, trees,
invariants: docs/design.md.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from .errors import check_int

MAX_BLOCK_SIZE = 2**16  # tokens per block: a block is allocated whole, so its size bounds the smallest allocation


class CacheExhausted(RuntimeError):
    """The block pool cannot hold what was asked; nothing was changed."""


class BlockAllocator:
    """A free list and reference counts over `num_blocks` block ids."""

    def __init__(self, num_blocks: int, allow_empty: bool = False):
        check_int("num_blocks", num_blocks, 0 if allow_empty else 1)
        self.num_blocks = 0
        self.refcount: list[int] = []
        self.free_ids: list[int] = []
        self.grow(num_blocks)

    def grow(self, n: int) -> None:
        """Add n blocks (ids num_blocks .. num_blocks + n - 1), handed out before the ones already free."""
        first = self.num_blocks
        self.num_blocks += n
        self.refcount += [0] * n
        self.free_ids += range(self.num_blocks - 1, first - 1, -1)  # pop() hands out first, first + 1, ...

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def allocate(self) -> int:
        if not self.free_ids:
            raise CacheExhausted(f"all {self.num_blocks} KV blocks are in use")
        b = self.free_ids.pop()
        self.refcount[b] = 1
        return b

    def share(self, block: int) -> int:
        """One more owner for `block` (used by fork)."""
        if self.refcount[block] < 1:
            raise ValueError(f"block {block} is not allocated")
        self.refcount[block] += 1
        return block

    def free(self, block: int) -> None:
        """One owner fewer; the block returns to the pool with its last owner."""
        if self.refcount[block] < 1:
            raise ValueError(f"double free of block {block}")
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self.free_ids.append(block)


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


class PagedKVCache:
    """K/V pools for every layer, and the block tables of the sequences that use them."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, num_blocks: int | None = None,
                 block_size: int = 16, memory_bytes: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", max_blocks: int | None = None):
        """A fixed pool of num_blocks blocks, or of as many as memory_bytes holds; given neither, a pool
        that grows on demand, without bound or up to max_blocks blocks."""
        check_int("block_size", block_size, 1, MAX_BLOCK_SIZE)
        itemsize = torch.empty((), dtype=dtype).element_size()
        bytes_per_block = 2 * n_layers * block_size * n_kv_heads * head_dim * itemsize
        self.growable = num_blocks is None and memory_bytes is None
        if max_blocks is not None and not self.growable:
            raise ValueError("max_blocks bounds a growing cache: give it without num_blocks and memory_bytes")
        self.max_blocks = None if max_blocks is None else check_int("max_blocks", max_blocks, 1)
        if num_blocks is None and memory_bytes is not None:
            num_blocks = check_int("memory_bytes", memory_bytes, 0) // bytes_per_block
            if num_blocks < 1:
                raise ValueError(f"memory_bytes={memory_bytes} holds no block "
                                 f"(one block needs {bytes_per_block} bytes)")
        self.block_size = block_size
        self.allocator = BlockAllocator(0 if self.growable else num_blocks, allow_empty=self.growable)
        # (n_layers, num_blocks * block_size, 2 * n_kv_heads, head_dim): a flat slot axis per layer,
        # keys in the first n_kv_heads rows of a slot, values in the rest
        self.n_kv_heads = n_kv_heads
        self.kv = torch.zeros((n_layers, self.num_blocks * block_size, 2 * n_kv_heads, head_dim), dtype=dtype,
                              device=device)
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        # seq -> {token index: its parent's index} for the tokens of a tree round, from the first one appended with
        # parents to the sequence's end; a token not listed follows the one before it (a chain)
        self.parents: dict[int, dict[int, int]] = {}
        self._ids = itertools.count()

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def k(self) -> torch.Tensor:
        """Keys of every layer and slot, (n_layers, num_slots, n_kv_heads, head_dim): a view of the pool."""
        return self.kv[:, :, :self.n_kv_heads]

    @property
    def v(self) -> torch.Tensor:
        """Values of every layer and slot, (n_layers, num_slots, n_kv_heads, head_dim): a view of the pool."""
        return self.kv[:, :, self.n_kv_heads:]

    @property
    def device(self) -> torch.device:
        return self.kv.device

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def new_sequence(self) -> int:
        sid = next(self._ids)
        self.tables[sid] = []
        self.lengths[sid] = 0
        return sid

    def length(self, seq: int) -> int:
        return self.lengths[seq]

    def fork(self, seq: int) -> int:
        """A new sequence sharing all of `seq`'s blocks (same prefix, no copy)."""
        child = self.new_sequence()
        self.tables[child] = [self.allocator.share(b) for b in self.tables[seq]]
        self.lengths[child] = self.lengths[seq]
        if seq in self.parents:
            self.parents[child] = dict(self.parents[seq])
        return child

    def free(self, seq: int) -> None:
        for b in self.tables.pop(seq):
            self.allocator.free(b)
        del self.lengths[seq]
        self.parents.pop(seq, None)

    def ancestry(self, seq: int, i: int) -> tuple[int, list[int]]:
        """The tokens token i of `seq` attends, as (n, tail): tokens 0..n-1 (its chain of ancestors) then the tree
        tokens `tail` (its ancestors after them and itself, root first). Its position is n + len(tail) - 1."""
        par, tail = self.parents.get(seq, {}), []
        while i in par:
            tail.append(i)
            i = par[i]
        return i + 1, tail[::-1]

    def path_moves(self, seq: int, start: int, keep: list[int]) -> list[tuple[int, int]]:
        """The (from, to) slot copies that `keep_path(seq, start, keep)` makes, after checking that `keep` is a
        path: ascending indices from `start` on, each one's parent the one before (the first's: token start - 1),
        with every token before `start` in a chain. Plain bookkeeping: no tensor is read or written."""
        par, length = self.parents.get(seq, {}), self.lengths[seq]
        if not 1 <= start <= length or any(par.get(i, i - 1) != i - 1 for i in range(start)):
            raise ValueError(f"keep_path: tokens before {start} of sequence {seq} (length {length}) must be a chain")
        for before, i in zip([start - 1, *keep], keep):
            if not before < i < length or par.get(i, i - 1) != before:
                raise ValueError(f"keep_path: {keep} is not a path from token {start - 1} of sequence {seq}")
        slots = self.slots(seq)
        return [(slots[i], slots[start + j]) for j, i in enumerate(keep) if i != start + j]

    @torch.inference_mode()  # the pool may have been made or grown in a model pass: an inference tensor
    def keep_path(self, seq: int, start: int, keep: list[int]) -> None:
        """A tree round's end: the tokens at indices `keep` (a path, see path_moves) become tokens start,
        start + 1, ... with their K/V (computed at the positions they now have), and every other token from
        `start` on is dropped. The sequence is a chain again."""
        self.path_moves(seq, start, keep)  # checked before anything changes
        for idx in range(start // self.block_size, self.blocks_for(start + len(keep))):
            self._own_block(seq, idx)  # the blocks written to must be this sequence's alone
        moves = self.path_moves(seq, start, keep)
        if moves:  # advanced indexing reads every source before it writes: overlapping moves are safe
            src, dst = (torch.tensor(x, dtype=torch.long, device=self.device) for x in zip(*moves))
            self.kv[:, dst] = self.kv[:, src]
        self.parents.pop(seq, None)
        self.truncate(seq, start + len(keep))

    def truncate(self, seq: int, new_len: int) -> None:
        """Roll `seq` back to its first `new_len` tokens; tail blocks return to the pool."""
        if not 0 <= new_len <= self.lengths[seq]:
            raise ValueError(f"cannot truncate sequence {seq} of length {self.lengths[seq]} to {new_len}")
        table = self.tables[seq]
        keep = self.blocks_for(new_len)
        for b in table[keep:]:
            self.allocator.free(b)
        del table[keep:]
        self.lengths[seq] = new_len
        par = self.parents.get(seq)
        if par is not None:
            for i in [i for i in par if i >= new_len]:
                del par[i]
            if not par:
                del self.parents[seq]

    def _own_block(self, seq: int, idx: int) -> None:
        """Copy-on-write: make block table[idx] of `seq` its own (a copy, if another sequence shares it)."""
        table, bs = self.tables[seq], self.block_size
        old = table[idx]
        if self.allocator.refcount[old] > 1:
            new = self.allocator.allocate()
            self.kv[:, new * bs:(new + 1) * bs] = self.kv[:, old * bs:(old + 1) * bs]
            self.allocator.free(old)
            table[idx] = new

    def _must_copy(self, seq: int, n_new: int) -> bool:
        """Whether appending n_new tokens to `seq` must first copy its last block (partial, and shared)."""
        table = self.tables[seq]
        return n_new > 0 and self.lengths[seq] % self.block_size > 0 and self.allocator.refcount[table[-1]] > 1

    def _blocks_needed(self, seq: int, n_new: int) -> int:
        """Fresh blocks `seq` needs to append n_new tokens, counting a copy-on-write copy."""
        return self.blocks_for(self.lengths[seq] + n_new) - len(self.tables[seq]) + self._must_copy(seq, n_new)

    def reserve(self, seqs: list[int], n_new: list[int]) -> list[list[int]]:
        """Make room to append n_new[i] tokens to seqs[i]; return each one's new slots.

        All-or-nothing: if the pool cannot hold everything, raise CacheExhausted
        before any block is allocated or copied. Lengths grow by n_new.
        """
        if len(set(seqs)) != len(seqs):
            raise ValueError("a sequence appears twice in one reserve call")
        need = sum(self._blocks_needed(s, n) for s, n in zip(seqs, n_new))
        if need > self.allocator.num_free:
            self._grow(need - self.allocator.num_free)
        if need > self.allocator.num_free:
            limit = (f"raise the growing cache's max_blocks={self.max_blocks}" if self.growable else
                     "make the cache larger (num_blocks / memory_bytes)")
            raise CacheExhausted(
                f"KV cache exhausted: appending {sum(n_new)} tokens needs {need} free blocks, "
                f"{self.allocator.num_free} of {self.num_blocks} are free (block_size={self.block_size}); "
                f"{limit} or free finished sequences")
        out = []
        for s, n in zip(seqs, n_new):
            table, length = self.tables[s], self.lengths[s]
            if self._must_copy(s, n):
                self._own_block(s, len(table) - 1)
            while len(table) < self.blocks_for(length + n):
                table.append(self.allocator.allocate())
            self.lengths[s] = length + n
            out.append(self.slots(s, start=length))
        return out

    def _grow(self, short: int) -> None:
        """A growing pool `short` blocks short: reallocate it to at least twice its size (capped at max_blocks).

        Doubling keeps the copying linear in the final size. Nothing changes when even the cap is too small."""
        if not self.growable:
            return
        n = max(self.num_blocks + short, 2 * self.num_blocks)
        if self.max_blocks is not None:
            if self.num_blocks + short > self.max_blocks:
                return
            n = min(n, self.max_blocks)
        L, _, H2, D = self.kv.shape
        kv = torch.zeros((L, n * self.block_size, H2, D), dtype=self.kv.dtype, device=self.kv.device)
        kv[:, :self.kv.shape[1]] = self.kv
        self.kv = kv
        self.allocator.grow(n - self.num_blocks)

    def slots(self, seq: int, start: int = 0) -> list[int]:
        """Pool slots of the tokens `seq` holds from position `start` on, in order."""
        bs, table = self.block_size, self.tables[seq]
        return [table[t // bs] * bs + t % bs for t in range(start, self.lengths[seq])]

    def prepare(self, seqs: list[int], n_new: list[int], parents: list[list[int] | None] | None = None
                ) -> AttentionMetadata:
        """Reserve room for the new tokens and build the metadata for one forward pass.

        parents[b] (a tree round): for each new token of seqs[b], the index in the sequence of the token it
        follows (an earlier one); None, or no parents at all: each follows the token before it."""
        starts = [self.lengths[s] for s in seqs]
        for b, s in enumerate(seqs):
            par = None if parents is None else parents[b]
            i0 = starts[b]
            if par is not None and (len(par) != n_new[b] or any(not (x == i0 + t - 1 or 0 <= x < i0 + t)
                                                                for t, x in enumerate(par))):
                raise ValueError(f"parents of sequence {s}: {n_new[b]} indices, each of an earlier token; got {par}")
        new_slots = self.reserve(seqs, n_new)
        for b, s in enumerate(seqs):  # a tree's tokens, and a chain's appended after them, get their parents noted
            par = None if parents is None else parents[b]
            if par is not None or s in self.parents:
                self.parents.setdefault(s, {}).update(
                    (starts[b] + t, starts[b] + t - 1 if par is None else par[t]) for t in range(n_new[b]))
        ctx = [st + n for st, n in zip(starts, n_new)]  # each sequence's context length after the step
        B, T, L, dev = len(seqs), max(n_new), max(ctx), self.device
        positions = torch.zeros(B, T, dtype=torch.long)
        valid = torch.zeros(B, T, dtype=torch.bool)
        read = torch.zeros(B, L, dtype=torch.long)
        for b, s in enumerate(seqs):
            positions[b, :n_new[b]] = torch.arange(starts[b], ctx[b])
            valid[b, :n_new[b]] = True
            read[b, :ctx[b]] = torch.tensor(self.slots(s), dtype=torch.long)
        write = torch.tensor([x for sl in new_slots for x in sl], dtype=torch.long)
        trees = [b for b, s in enumerate(seqs) if s in self.parents]
        keys = [[None] * T for _ in seqs] if trees else None
        for b in trees:  # a tree token sits at the position of its depth and attends its ancestors only
            for t in range(n_new[b]):
                n, tail = self.ancestry(seqs[b], starts[b] + t)
                if tail != list(range(n, n + len(tail))):  # (else its ancestors are the tokens before it: a chain)
                    keys[b][t] = torch.cat((torch.arange(n), torch.tensor(tail, dtype=torch.long)))
                    positions[b, t] = n + len(tail) - 1
        mask = None
        if T > 1 or min(ctx) < L or trees:
            key_pos = torch.arange(L)
            # key j is visible to the query at absolute position p iff j <= p (the context is causal)
            mask = key_pos.view(1, 1, 1, L) <= positions.view(B, 1, T, 1)
            for b in trees:
                for t, k in enumerate(keys[b]):
                    if k is not None:
                        mask[b, 0, t] = False
                        mask[b, 0, t, k] = True
            # padding queries see key 0 only, so softmax stays finite; their outputs are discarded
            mask = (mask | (~valid).view(B, 1, T, 1) & (key_pos == 0).view(1, 1, 1, L)).to(dev)
        read_range = None
        if B == 1 and int(read[0, -1]) - int(read[0, 0]) == L - 1 and (L == 1 or bool((read[0].diff() == 1).all())):
            read_range = (int(read[0, 0]), int(read[0, 0]) + L)
        if keys is not None:
            keys = [[None if k is None else k.to(dev) for k in row] for row in keys]
        return AttentionMetadata(positions.to(dev), write.to(dev), valid.to(dev), read.to(dev), read_range, mask, keys)

    def check_consistency(self) -> None:
        """Assert that the refcounts equal the block-table references (used by the tests)."""
        counts = [0] * self.num_blocks
        for s, table in self.tables.items():
            assert len(table) == self.blocks_for(self.lengths[s]), f"sequence {s}: table/length mismatch"
            for b in table:
                counts[b] += 1
        assert counts == self.allocator.refcount, "refcounts differ from block-table references"
        free = set(self.allocator.free_ids)
        assert len(free) == len(self.allocator.free_ids), "a block is on the free list twice"
        unreferenced = {b for b in range(self.num_blocks) if counts[b] == 0}
        assert free == unreferenced, "free list differs from unreferenced blocks"
        for s, par in self.parents.items():
            assert par and all(-1 <= p < i < self.lengths[s] for i, p in par.items()), f"sequence {s}: bad parents"
            assert set(par) == set(range(min(par), self.lengths[s])), f"sequence {s}: a tree's tail is not whole"
