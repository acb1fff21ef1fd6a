"""Paged KV cache: allocator invariants (property-based), exhaustion, fork and copy-on-write."""

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minispec import BlockAllocator, CacheExhausted, PagedKVCache


def small_cache(num_blocks=12, block_size=3):
    return PagedKVCache(n_layers=2, n_kv_heads=1, head_dim=2, num_blocks=num_blocks, block_size=block_size)


def write_tokens(cache, seq, values):
    """Append tokens whose K entries are their values, so reads can be checked."""
    (slots,) = cache.reserve([seq], [len(values)])
    cache.k[:, slots] = torch.tensor(values, dtype=torch.float32).view(1, -1, 1, 1)


def read_tokens(cache, seq):
    return cache.k[0, cache.slots(seq), 0, 0].tolist()


def test_allocator_basics():
    a = BlockAllocator(3)
    b0, b1 = a.allocate(), a.allocate()
    assert (b0, b1, a.num_free) == (0, 1, 1)
    a.share(b0)
    a.free(b0)
    assert a.num_free == 1  # still owned once
    a.free(b0)
    assert a.num_free == 2
    with pytest.raises(ValueError, match="double free"):
        a.free(b0)
    a.allocate(), a.allocate()
    with pytest.raises(CacheExhausted):
        a.allocate()


def test_memory_budget_sizes_the_pool():
    c = PagedKVCache(n_layers=2, n_kv_heads=2, head_dim=4, block_size=4, memory_bytes=10_000)
    per_block = 2 * 2 * 4 * 2 * 4 * 4  # K and V, layers, block, heads, dim, fp32 bytes
    assert c.num_blocks == 10_000 // per_block
    with pytest.raises(ValueError, match="holds no block"):
        PagedKVCache(n_layers=2, n_kv_heads=2, head_dim=4, block_size=4, memory_bytes=10)


def test_exhaustion_changes_nothing():
    c = small_cache(num_blocks=4, block_size=2)
    a, b = c.new_sequence(), c.new_sequence()
    write_tokens(c, a, [1, 2, 3])
    write_tokens(c, b, [4])
    before = (dict(c.lengths), {s: list(t) for s, t in c.tables.items()}, c.allocator.num_free, c.k.clone())
    with pytest.raises(CacheExhausted, match="needs 2 free blocks, 1 of 4 are free"):
        c.reserve([a, b], [2, 3])
    assert (dict(c.lengths), {s: list(t) for s, t in c.tables.items()}, c.allocator.num_free) == before[:3]
    assert torch.equal(c.k, before[3])
    assert read_tokens(c, a) == [1, 2, 3] and read_tokens(c, b) == [4]
    c.check_consistency()


def test_fork_shares_then_copy_on_write_keeps_parent():
    c = small_cache(block_size=4)
    parent = c.new_sequence()
    write_tokens(c, parent, [1, 2, 3, 4, 5, 6])  # one full block, one partial block
    child = c.fork(parent)
    assert c.tables[child] == c.tables[parent]
    free_before = c.allocator.num_free
    write_tokens(c, child, [70, 80])  # writes into the shared partial block: must copy first
    assert c.tables[child][0] == c.tables[parent][0]  # the full block stays shared
    assert c.tables[child][1] != c.tables[parent][1]
    assert c.allocator.num_free == free_before - 1
    assert read_tokens(c, parent) == [1, 2, 3, 4, 5, 6]
    assert read_tokens(c, child) == [1, 2, 3, 4, 5, 6, 70, 80]
    write_tokens(c, parent, [9])
    assert read_tokens(c, parent) == [1, 2, 3, 4, 5, 6, 9]
    c.check_consistency()


def test_truncate_then_write_does_not_touch_a_sibling():
    c = small_cache(block_size=4)
    a = c.new_sequence()
    write_tokens(c, a, [1, 2, 3, 4, 5, 6, 7, 8])
    b = c.fork(a)
    c.truncate(a, 2)  # a now ends inside the block it shares with b
    write_tokens(c, a, [30, 40])
    assert read_tokens(c, a) == [1, 2, 30, 40]
    assert read_tokens(c, b) == [1, 2, 3, 4, 5, 6, 7, 8]
    c.check_consistency()
    with pytest.raises(ValueError, match="cannot truncate"):
        c.truncate(a, 5)


class CacheMachine(RuleBasedStateMachine):
    """Random append / truncate / fork / free: no leak, no double free, contents always right."""

    @initialize(num_blocks=st.integers(1, 16), block_size=st.integers(1, 4))
    def setup(self, num_blocks, block_size):
        self.cache = small_cache(num_blocks, block_size)
        self.model = {}  # seq -> expected token values
        self.counter = 0

    @rule()
    def new(self):
        self.model[self.cache.new_sequence()] = []

    @precondition(lambda self: self.model)
    @rule(data=st.data(), n=st.integers(1, 5))
    def append(self, data, n):
        seq = data.draw(st.sampled_from(sorted(self.model)))
        vals = [float(self.counter + i) for i in range(n)]
        try:
            write_tokens(self.cache, seq, vals)
        except CacheExhausted:
            return  # state must be unchanged: the invariant checks it
        self.counter += n
        self.model[seq] += vals

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def truncate(self, data):
        seq = data.draw(st.sampled_from(sorted(self.model)))
        new_len = data.draw(st.integers(0, len(self.model[seq])))
        self.cache.truncate(seq, new_len)
        del self.model[seq][new_len:]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data):
        seq = data.draw(st.sampled_from(sorted(self.model)))
        child = self.cache.fork(seq)
        self.model[child] = list(self.model[seq])

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.model)))
        self.cache.free(seq)
        del self.model[seq]

    @invariant()
    def consistent(self):
        if not hasattr(self, "cache"):
            return
        self.cache.check_consistency()
        for seq, vals in self.model.items():
            assert self.cache.length(seq) == len(vals)
            assert read_tokens(self.cache, seq) == vals  # forks see identical prefixes; CoW kept parents intact

    def teardown(self):
        if hasattr(self, "cache"):
            for seq in list(self.model):
                self.cache.free(seq)
            assert self.cache.allocator.num_free == self.cache.num_blocks  # nothing leaked


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=300, stateful_step_count=50, deadline=None, derandomize=True)
