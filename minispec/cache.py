"""Paged KV cache: a block pool, per-sequence block tables, rollback and fork.

After vLLM's PagedAttention and nano-vllm's block manager. `BlockAllocator` is plain Python (a free
list and reference counts); `PagedKVCache` owns the tensors: one pool per layer holding K and V side
by side (one write and one gather per layer and step), and each sequence's block table and length.
The pool is fixed (`num_blocks`, or what `memory_bytes` holds) or, given neither, grows on demand by
doubling (up to `max_blocks`). What a forward pass reads and writes (`passes.prepare`) and the token trees of
a tree round (`passes.TokenTrees`, `passes.keep_path`) live in minispec.passes; the cache holds a
`TokenTrees` beside its block tables only so that fork, free and truncate keep the two in step. Slot layout,
copy-on-write, rollback, invariants: docs/design.md.
"""

from __future__ import annotations

import itertools

import torch

from .errors import check_int
from .passes import TokenTrees

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
        self.trees = TokenTrees()  # the tree tokens of each sequence, kept in step by fork, free and truncate
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
        self.trees.fork(seq, child)
        return child

    def free(self, seq: int) -> None:
        for b in self.tables.pop(seq):
            self.allocator.free(b)
        del self.lengths[seq]
        self.trees.drop(seq)

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
        self.trees.truncate(seq, new_len)

    @torch.inference_mode()  # the pool may have been made or grown in a model pass: an inference tensor
    def move_tokens(self, seq: int, moves: list[tuple[int, int]], first: int, end: int) -> None:
        """Copy the K/V of token `from` of `seq` to token `to`, for each (from, to) in moves, after making the blocks
        of its tokens first..end-1 its own (copy-on-write: the tokens written to must be this sequence's alone)."""
        for idx in range(first // self.block_size, self.blocks_for(end)):
            self._own_block(seq, idx)
        if moves:  # advanced indexing reads every source before it writes: overlapping moves are safe
            slots = self.slots(seq)
            src, dst = (torch.tensor([slots[i] for i in x], dtype=torch.long, device=self.device) for x in zip(*moves))
            self.kv[:, dst] = self.kv[:, src]

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
        self.trees.check(self.lengths)
