"""Token trees: the cache's tree bookkeeping and compaction, one pass scoring every node as a chain would, the walk,
the children drawn without replacement, and greedy tree speculation equal to greedy generation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minispec import PagedKVCache, passes
from minispec.errors import GenerationError
from minispec.passes import keep_path
from minispec.speculative import greedy_tree_verify, residual, tree_verify, verify
from minispec.tree import check_tree, draw_children, tree_size

from helpers import kept_int4, peaked_model, truncated

V = 16


def small_cache(num_blocks=16, block_size=3):
    return PagedKVCache(n_layers=1, n_kv_heads=1, head_dim=1, num_blocks=num_blocks, block_size=block_size)


def append(cache, seq, values, parents=None):
    """Append tokens (with parents: tree tokens) whose K entries are their values, as a model pass would."""
    start = cache.length(seq)
    passes.prepare(cache, [seq], [len(values)], None if parents is None else [parents])
    slots = cache.slots(seq, start)
    cache.k[:, slots] = torch.tensor(values, dtype=torch.float32).view(1, -1, 1, 1)


def read(cache, seq):
    return cache.k[0, cache.slots(seq), 0, 0].tolist()


# ---- the cache: plain bookkeeping, then compaction


def test_tree_tokens_attend_their_ancestors_at_the_positions_of_their_depth():
    c = small_cache()
    s = c.new_sequence()
    append(c, s, [0, 1, 2])
    # a tree under token 2: a (3) and b (4) its children, c (5) under a, d (6) under b
    append(c, s, [3, 4, 5, 6], parents=[2, 2, 3, 4])
    assert c.trees.ancestry(s, 1) == (2, [])  # a chain token: tokens 0..1
    assert c.trees.ancestry(s, 4) == (3, [4])
    assert c.trees.ancestry(s, 6) == (3, [4, 6])  # not 3 or 5: a sibling's subtree is invisible
    c.check_consistency()
    c.truncate(s, 5)
    assert c.trees.parents[s] == {3: 2, 4: 2}
    c.truncate(s, 3)
    assert s not in c.trees  # a chain again
    c.check_consistency()


def test_the_metadata_of_a_tree_pass():
    c = small_cache()
    s = c.new_sequence()
    append(c, s, [0])
    meta = passes.prepare(c, [s], [5], [[0, 1, 1, 2, 4]])
    # token 1 again (a chain), 2 and 3 its children, 4 under 2, 5 under 4
    assert meta.positions[0].tolist() == [1, 2, 2, 3, 4]
    visible = meta.mask[0, 0].int().tolist()
    assert visible == [[1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 0, 1, 0, 0], [1, 1, 1, 0, 1, 0],
                       [1, 1, 1, 0, 1, 1]]
    ends = meta.row_ends()[0]
    # a token whose ancestors are the tokens before it keeps a count (a chain's row); the others their keys
    assert ends[:2] == [2, 3] and [k.tolist() for k in ends[2:]] == [[0, 1, 3], [0, 1, 2, 4], [0, 1, 2, 4, 5]]


def test_path_moves_are_plain_bookkeeping():
    c = small_cache(block_size=2)
    s = c.new_sequence()
    passes.prepare(c, [s], [3])
    passes.prepare(c, [s], [4], [[2, 2, 3, 4]])  # tokens 3, 4 under 2; 5 under 3; 6 under 4
    n = c.length(s)
    assert c.trees.path_moves(s, 3, [4, 6], n) == [(4, 3), (6, 4)]
    assert c.trees.path_moves(s, 3, [3, 5], n) == [(5, 4)]  # the first stays where it is
    assert c.trees.path_moves(s, 3, [], n) == []
    for bad in ([5], [4, 5], [3, 6], [6, 4]):
        with pytest.raises(ValueError, match="not a path"):
            c.trees.path_moves(s, 3, bad, n)
    with pytest.raises(ValueError, match="must be a chain"):
        c.trees.path_moves(s, 5, [6], n)


@pytest.mark.parametrize("block_size", [1, 2, 3, 16])
def test_keep_path_keeps_the_path_and_drops_the_rest(block_size):
    c = small_cache(num_blocks=40, block_size=block_size)
    s = c.new_sequence()
    append(c, s, [10, 11, 12])
    other = c.fork(s)  # shares the prefix's blocks: keep_path must not write into them
    append(c, s, [20, 21, 22, 23, 24], parents=[2, 2, 3, 4, 6])  # a chain of 20, 22 and two trees under 21
    keep_path(c, s, 3, [4, 6, 7])
    assert read(c, s) == [10, 11, 12, 21, 23, 24] and s not in c.trees
    assert read(c, other) == [10, 11, 12]
    c.check_consistency()
    append(c, s, [30])  # a chain again: appends where the path ends
    assert read(c, s) == [10, 11, 12, 21, 23, 24, 30]
    c.free(s)
    c.free(other)
    c.check_consistency()
    assert c.allocator.num_free == c.num_blocks


@settings(derandomize=True, deadline=None, max_examples=150)
@given(data=st.data(), block_size=st.integers(1, 4), prefix=st.integers(1, 9), n=st.integers(0, 12))
def test_keep_path_on_random_trees_beside_forks(data, block_size, prefix, n):
    """Any tree after any prefix, shared or not: the kept path reads back in order, the forks are untouched, every
    block comes back once all are freed."""
    c = small_cache(num_blocks=64, block_size=block_size)
    s = c.new_sequence()
    append(c, s, [float(i) for i in range(prefix)])
    fork = c.fork(s) if data.draw(st.booleans()) else None
    parents = [data.draw(st.integers(prefix - 1, prefix + j - 1)) for j in range(n)]
    append(c, s, [100.0 + j for j in range(n)], parents=parents)
    node = data.draw(st.integers(prefix - 1, prefix + n - 1))  # the path's last token (prefix - 1: an empty path)
    path = []
    while node >= prefix:
        path.append(node)
        node = parents[node - prefix]
    keep_path(c, s, prefix, path[::-1])
    assert read(c, s) == [float(i) for i in range(prefix)] + [100.0 + i - prefix for i in path[::-1]]
    c.check_consistency()
    if fork is not None:
        assert read(c, fork) == [float(i) for i in range(prefix)]
        c.free(fork)
    c.free(s)
    assert c.allocator.num_free == c.num_blocks


# ---- one pass scores every node as a chain along its path would


TOKENS, PARENTS = [7, 8, 9, 10, 11, 12], [-1, -1, 0, 1, 2, 0]  # node j's parent (-1: the last committed token)


def path_of(j):
    out = []
    while j >= 0:
        out.append(TOKENS[j])
        j = PARENTS[j]
    return out[::-1]


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    target = peaked_model(0, V, n_layers=3)
    return {"target": target, "truncated": truncated(target), "small": peaked_model(1, V, dim=16, n_layers=1)}


@pytest.mark.parametrize("form", ["fp32", "bf16", "int4"])
def test_a_tree_pass_gives_each_node_the_logits_of_its_path(models, form, tmp_path):
    """Every node's logits are those of a decode step at the end of its path: in bf16 and a kept int4 model (rows
    each computed alone, attended over exactly their own keys) to the bit, in fp32 to rounding."""
    target = {"fp32": lambda: models["target"], "bf16": lambda: peaked_model(0, V, n_layers=3).to(torch.bfloat16),
              "int4": lambda: kept_int4(models["target"], tmp_path / "int4")}[form]()
    ctx = [1, 2, 3, 4, 5]
    for block_size in (2, 16):
        c = target.new_cache(block_size=block_size)
        s = c.new_sequence()
        target.step(c, [s], [ctx[:-1]])
        root = len(ctx) - 1
        parents = [root - 1] + [root if p < 0 else root + 1 + p for p in PARENTS]
        got = target.step(c, [s], [ctx[-1:] + TOKENS], all_logits=True, parents=[parents])[0]
        for j in range(-1, len(TOKENS)):
            seq = ctx + (path_of(j) if j >= 0 else [])
            ref = target.new_cache(block_size=block_size)
            r = ref.new_sequence()
            target.step(ref, [r], [seq[:-1]])
            want = target.step(ref, [r], [seq[-1:]])[0]
            if form == "fp32":
                torch.testing.assert_close(got[j + 1], want, rtol=1e-4, atol=1e-4)
            else:
                assert torch.equal(got[j + 1], want), (form, j)


# ---- the walk


@settings(derandomize=True, deadline=None, max_examples=60)
@given(k=st.integers(0, 4), seed=st.integers(0, 10**6))
def test_the_walk_of_a_chain_is_verify(k, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(k + 1, 6, generator=g, dtype=torch.float64) ** 3
    q = torch.rand(k, 6, generator=g, dtype=torch.float64) ** 3
    p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(k)]
    u = torch.rand(k + 1, generator=g, dtype=torch.float64)
    path, nxt = tree_verify(drafts, list(range(-1, k - 1)), q, p, u)
    assert (len(path), nxt) == verify(drafts, q, p, u) and path == list(range(len(path)))


def test_the_walk_by_hand():
    p = torch.tensor([[0.5, 0.3, 0.2], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    q = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5], [1 / 3, 1 / 3, 1 / 3]], dtype=torch.float64)
    # the root's children: node 0 (token 1, q one-hot) and node 1 (token 2, drawn from q without token 1); node 2
    # (token 0) under node 0
    drafts, parents = [1, 2, 0], [-1, -1, 0]
    # node 0 accepted (0.29 < 0.3 / 1), then node 2 rejected (p[1] has no mass on 0): the next token from p[1]
    assert tree_verify(drafts, parents, q, p, torch.tensor([0.29, 0.0, 0.99, 0.5], dtype=torch.float64)) == ([0], 1)
    # node 0 rejected: node 1 tested against norm(max(0, p[0] - q[0])) = (5/7, 0, 2/7): 2/7 / 0.5 = 4/7
    u = torch.tensor([0.31, 0.57, 0.0, 0.5], dtype=torch.float64)
    assert tree_verify(drafts, parents, q, p, u) == ([1], 2)  # a leaf: the bonus token from p[2]
    u[1] = 0.58  # rejected too: the next token from norm(max(0, (5/7, 0, 2/7) - q[1])) = (1, 0, 0)
    assert tree_verify(drafts, parents, q, p, u) == ([], 0)
    r = residual(residual(p[0], q[0]), q[1])
    assert r.tolist() == [1.0, 0.0, 0.0]
    # the negative control tests node 1 against p[0] itself: 0.2 / 0.5 = 0.4
    assert tree_verify(drafts, parents, q, p, u, siblings_see_residual=False)[0] == []
    assert tree_verify(drafts, parents, q, p, torch.tensor([0.31, 0.39, 0, 0.5], dtype=torch.float64),
                       siblings_see_residual=False)[0] == [1]
    with pytest.raises(ValueError, match="has q = 0"):
        tree_verify([0, 2, 0], parents, q, p, u)
    assert greedy_tree_verify([1, 2, 0], parents, [1, 1, 2, 0]) == ([0], 1)  # node 2 (token 0) is not p[1]'s argmax
    assert greedy_tree_verify([1, 2, 0], parents, [2, 1, 2, 0]) == ([1], 2)
    assert greedy_tree_verify([1, 2, 0], parents, [0, 1, 2, 0]) == ([], 0)


def test_children_are_drawn_without_replacement():
    probs = torch.tensor([0.5, 0.25, 0.25, 0.0], dtype=torch.float64)
    kids, qs = draw_children(probs, 4, torch.tensor([0.1, 0.1, 0.1, 0.1], dtype=torch.float64))
    assert kids == [0, 1, 2]  # the support ran out
    assert [q.tolist() for q in qs] == [[0.5, 0.25, 0.25, 0.0], [0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 1.0, 0.0]]


def test_the_cost_of_a_tree_round():
    from minispec.adaptive import round_cost, tree_round_cost
    assert tree_round_cost((1, 1, 1), lambda w: 0.1 * w, 1.5) == pytest.approx(round_cost(3, 0.1, 1.5))
    # passes over 1, 3 and 6 tokens (the root, then the nodes of depths 1 and 2)
    assert tree_round_cost((3, 2, 1), lambda w: 0.1 + 0.01 * w, 2.0) == pytest.approx(2.0 + 0.3 + 0.1)


def test_tree_shapes():
    assert check_tree([2, 2, 1]) == (2, 2, 1) and tree_size((2, 2, 1)) == 2 + 4 + 4
    for bad in ((), (0,), (2, 1.5), "22", None, (True,)):
        with pytest.raises(ValueError, match="tree must be"):
            check_tree(bad)
    with pytest.raises(ValueError, match="more than"):
        check_tree((8, 8, 8))


# ---- speculate with a tree


@settings(derandomize=True, deadline=None, max_examples=40)
@given(prompt=st.lists(st.integers(0, V - 1), min_size=1, max_size=10),
       tree=st.lists(st.integers(1, 3), min_size=1, max_size=4), block_size=st.sampled_from([1, 3, 16]),
       max_new=st.integers(0, 16), stops=st.lists(st.integers(0, V - 1), max_size=2),
       draft=st.sampled_from(["truncated", "small", "target"]))
def test_greedy_tree_equals_generate(models, prompt, tree, block_size, max_new, stops, draft):
    target = models["target"]
    want = target.generate(prompt, max_new_tokens=max_new, stop_tokens=stops)
    res = target.speculate(models[draft], prompt, tree=tuple(tree), max_new_tokens=max_new, stop_tokens=stops,
                           block_size=block_size)
    assert res.tokens == want and res.stats.committed == len(want)


def test_greedy_tree_equals_generate_for_a_bfloat16_target():
    target = peaked_model(0, V, n_layers=3).to(torch.bfloat16)
    draft = truncated(target).to(torch.bfloat16)
    for prompt in ([3], [1, 2, 3, 4, 5], [9, 9, 0]):
        want = target.generate(prompt, max_new_tokens=20, stop_tokens=[])
        for tree in ((3, 2, 1), (2, 2, 2, 2)):
            assert target.speculate(draft, prompt, tree=tree, max_new_tokens=20, stop_tokens=[]).tokens == want


def test_a_tree_commits_more_per_pass_than_its_chain(models):
    target = models["target"]
    prompts = [[t] for t in range(V)]
    chain = target.speculate(models["truncated"], prompts, k=3, max_new_tokens=12, stop_tokens=[])
    tree = target.speculate(models["truncated"], prompts, tree=(3, 2, 1), max_new_tokens=12, stop_tokens=[])
    assert tree.tokens == chain.tokens
    assert tree.stats.mean_accepted > chain.stats.mean_accepted


def test_caches_hold_exactly_the_committed_tokens_after_tree_rounds(models):
    target, draft = models["target"], models["truncated"]
    prompts = [[1, 2, 3], [7] * 9, [4], [1, 2, 3]]
    res = target.speculate(draft, prompts, tree=(2, 2, 1), max_new_tokens=11, temperature=1.0, seed=3, block_size=4,
                           keep_caches=True, stop_tokens=[])
    for rows, model in zip(res.caches, (target, draft)):
        rows.cache.check_consistency()
        assert not rows.cache.trees  # every tree compacted to its path
        for i, p in enumerate(prompts):
            committed = p + res.tokens[i]
            s = rows.seq[i]
            L = rows.cache.length(s)
            assert committed[L:] == rows.pending[i]
            fresh = model.new_cache(num_blocks=8, block_size=4)
            f = fresh.new_sequence()
            model.step(fresh, [f], [committed[:L]])
            torch.testing.assert_close(rows.cache.k[:, rows.cache.slots(s)], fresh.k[:, fresh.slots(f)])
            torch.testing.assert_close(rows.cache.v[:, rows.cache.slots(s)], fresh.v[:, fresh.slots(f)])


def test_batch_row_i_matches_single_run_with_seed_plus_i(models):
    target, draft = models["target"], models["truncated"]
    prompts = [[1, 2, 3], [5], [1, 2, 3]]
    res = target.speculate(draft, prompts, tree=(2, 2), max_new_tokens=12, temperature=1.0, seed=10, stop_tokens=[])
    for i, p in enumerate(prompts):
        single = target.speculate(draft, p, tree=(2, 2), max_new_tokens=12, temperature=1.0, seed=10 + i,
                                  stop_tokens=[])
        assert single.tokens == res.tokens[i]


def test_tree_errors(models):
    target = models["target"]
    with pytest.raises(GenerationError, match="not both"):
        target.speculate(models["small"], [1, 2], k=3, tree=(2, 2))
    with pytest.raises(GenerationError, match="tree must be"):
        target.speculate(models["small"], [1, 2], tree=(2, 0))
    with pytest.raises(GenerationError, match="drafts chains only"):
        target.speculate("prompt-lookup", [1, 2, 1, 2], tree=(2, 2))


def test_the_context_window_cuts_the_tree(models):
    target = peaked_model(0, V, n_layers=3, max_seq_len=20)
    prompt = [1, 2, 3, 4, 5, 6]
    want = target.generate(prompt, max_new_tokens=50, stop_tokens=[])
    assert len(want) == 20 - len(prompt)
    # (3, 3, 2) has 30 nodes, more than the window holds: shallower trees as the context grows
    for draft in (target, truncated(target, max_seq_len=12), truncated(target, max_seq_len=4)):
        assert target.speculate(draft, prompt, tree=(3, 3, 2), max_new_tokens=50, stop_tokens=[]).tokens == want


# ---- tree="auto": the cost model and the estimator


def test_expected_tree_tokens():
    from minispec.adaptive import expected_tokens
    from minispec.tree import expected_tree_tokens
    for a in (0.0, 0.3, 0.9, 1.0):
        for k in (1, 4):
            assert expected_tree_tokens(a, (1,) * k) == pytest.approx(expected_tokens(a, k))
    # (2, 2) at a = 0.5: each level is left with probability 1 - 0.5^2 = 0.75
    assert expected_tree_tokens(0.5, (2, 2)) == pytest.approx(1 + 0.75 + 0.75 ** 2)
    assert expected_tree_tokens(0.5, ()) == 1.0


def is_chain(shape):
    return len(shape) > 0 and all(b == 1 for b in shape)


@pytest.mark.parametrize("a", [0.4, 0.6, 0.8])
def test_best_tree_is_a_chain_when_rows_cost_and_a_tree_when_they_are_free(a):
    from minispec.tree import AUTO_SHAPES, best_tree
    c = 0.05  # a draft pass over one token, in target decode steps
    free = best_tree(a, lambda w: c, lambda n: 1.0)  # a pass costs the same whatever its width
    assert not is_chain(free) and free in AUTO_SHAPES, free
    dear = best_tree(a, lambda w: c * (1 + 0.3 * (w - 1)), lambda n: 1.0 + 0.3 * n)  # every row 0.3 of a step
    assert is_chain(dear), dear
    # a draft as costly as the target: plain decoding
    assert best_tree(a, lambda w: 1.0 * w, lambda n: 1.0 + n) == ()


def test_tested_children():
    from minispec.tree import tested_children
    parents = [-1, -1, 0, 0, 1]  # the root's children 0 and 1; 0's are 2 and 3, 1's is 4
    assert tested_children(parents, []) == 2  # both of the root's children rejected
    assert tested_children(parents, [1]) == 2 + 1  # 0 rejected, 1 accepted; then 4 rejected
    assert tested_children(parents, [0, 3]) == 1 + 2  # 3, a leaf, accepted after 2
    assert tested_children(parents, [1, 4]) == 2 + 1
    chain = [-1, 0, 1]
    assert [tested_children(chain, list(range(n))) for n in range(4)] == [1, 2, 3, 3]  # AdaptiveK's count


def estimator(acceptance, verify_s, draft_step_s=0.05):
    from minispec.tree import AdaptiveTree
    est = AdaptiveTree()
    est.successes, est.failures = 10 * acceptance, 10 * (1 - acceptance)
    est.draft_step_s, est.verify_s = draft_step_s, dict(verify_s)
    return est


def test_adaptive_tree_follows_the_measured_costs():
    flat = estimator(0.6, {0: 1.0, 4: 1.0, 14: 1.0})
    assert not is_chain(flat.choose_tree())
    steep = estimator(0.6, {0: 1.0, 4: 2.2})  # 0.3 a row, continued past 4 drafts
    assert is_chain(steep.choose_tree())
    plain = estimator(0.6, {0: 1.0, 1: 2.0}, draft_step_s=1.0)
    assert [plain.choose_tree() for _ in range(8)] == [()] * 7 + [(1,)]  # plain decoding, then a probe


def test_adaptive_tree_counts_a_round():
    est = estimator(0.5, {0: 1.0, 2: 1.0, 6: 1.0})
    est.successes = est.failures = 0.0
    parents = [-1, -1, 0, 0, 1, 1]
    est.update_tree([parents, parents], [[1, 4], []], draft_s=0.3, widths=[1, 2], verify_s=1.5)
    assert (est.successes, est.failures) == (2.0, 1.0 + 2.0)  # row 0: 0 rejected, 1 and 4 accepted; row 1: both out
    assert est.verify_s[6] == pytest.approx(0.97 * 1.0 + 0.03 * 1.5)
    # a pass over two tokens is priced as one (verify flat): 0.3 s over two passes
    assert est.draft_step_s == pytest.approx(0.97 * 0.05 + 0.03 * 0.15)


class Cycle:
    """An AdaptiveTree that takes its shapes from a list, round after round (plain, chains, trees mixed)."""

    def __new__(cls, shapes):
        from minispec.tree import AdaptiveTree

        class Cycling(AdaptiveTree):
            def choose_tree(self):
                self.i = getattr(self, "i", -1) + 1
                return shapes[self.i % len(shapes)]
        return Cycling()


MIXED = [(), (1, 1), (2, 2), (1,), (3, 1), (2, 1, 1)]


def test_greedy_tree_auto_equals_generate(models):
    target = models["target"]
    for prompt in ([3], [1, 2, 3, 4, 5]):
        want = target.generate(prompt, max_new_tokens=30, stop_tokens=[])
        auto = target.speculate(models["truncated"], prompt, tree="auto", max_new_tokens=30, stop_tokens=[])
        assert auto.tokens == want and auto.stats.tree_chosen
        mixed = target.speculate(models["truncated"], prompt, tree=Cycle(MIXED), max_new_tokens=30, stop_tokens=[],
                                 keep_caches=True)
        assert mixed.tokens == want and mixed.stats.tree_chosen == (MIXED * 30)[:len(mixed.stats.tree_chosen)]
        for rows in mixed.caches:
            rows.cache.check_consistency()
            assert not rows.cache.trees


def test_tree_auto_errors(models):
    target = models["target"]
    with pytest.raises(GenerationError, match="drafts chains only"):
        target.speculate("prompt-lookup", [1, 2, 1, 2], tree="auto")
    with pytest.raises(GenerationError, match="not both"):
        target.speculate(models["small"], [1, 2], k="auto", tree="auto")
    with pytest.raises(GenerationError, match="tree must be 'auto' or"):
        target.speculate(models["small"], [1, 2], tree="automatic")


# ---- DynamicTree: the draft places a round's nodes


def test_allocate_gives_the_width_to_the_likeliest_children():
    from minispec.tree import allocate
    dists = torch.tensor([[0.9, 0.05, 0.05, 0.0], [0.4, 0.3, 0.2, 0.1]])
    # terms value * m: node 0: 0.9*0.9 = .81, .045, .045; node 1: 0.1*0.4 = .04, .03, ...
    assert allocate([0.9, 0.1], dists, 4, 3) == [3, 0]
    assert allocate([0.5, 0.5], dists, 4, 3) == [1, 2]  # .45 | .2 .15 against .025
    assert allocate([0.5, 0.5], dists, 1, 3) == [1, 1]  # a node's cap
    assert allocate([1.0], torch.tensor([[1.0, 0.0, 0.0, 0.0]]), 4, 4) == [1]  # no child without probability
    assert allocate([], torch.zeros(0, 4), 2, 2) == []


def test_dynamic_tree_spec():
    from minispec.tree import DynamicTree, fitting, parse_tree, tree_text
    t = DynamicTree(4, 3)
    assert t.caps == (4, 4, 4) and tree_size(t.caps, t.width) == 12 and str(t) == "4x3"
    assert fitting(t.caps, 9, t.width) == (4, 4) and fitting(t.caps, 3, t.width) == ()
    assert parse_tree("4x3") == t and parse_tree("2,1") == (2, 1) and parse_tree("auto") == "auto"
    assert tree_text(t) == "4x3" and tree_text((2, 1)) == "2,1"
    for bad in ("4x", "x3", "0x3", "4x0", "2,a", "4x3x2"):
        with pytest.raises(GenerationError):
            parse_tree(bad)
    with pytest.raises(GenerationError, match="more than"):
        DynamicTree(100, 100)


def test_a_proposal_wider_than_the_width_is_refused():
    from minispec.tree import check_tree_proposal
    assert check_tree_proposal("D", 0, (3, 3), [5, 6, 7], [-1, -1, 0], width=2) == [-1, -1, 0]
    with pytest.raises(GenerationError, match="at most 2 nodes a depth"):
        check_tree_proposal("D", 0, (3, 3), [5, 6, 7], [-1, -1, -1], width=2)


@settings(derandomize=True, deadline=None, max_examples=30)
@given(prompt=st.lists(st.integers(0, V - 1), min_size=1, max_size=10), width=st.integers(1, 4),
       depth=st.integers(1, 4), block_size=st.sampled_from([1, 3, 16]), max_new=st.integers(0, 16),
       draft=st.sampled_from(["truncated", "small", "target"]))
def test_greedy_dynamic_tree_equals_generate(models, prompt, width, depth, block_size, max_new, draft):
    from minispec.tree import DynamicTree
    target = models["target"]
    want = target.generate(prompt, max_new_tokens=max_new, stop_tokens=[])
    res = target.speculate(models[draft], prompt, tree=DynamicTree(width, depth), max_new_tokens=max_new,
                           stop_tokens=[], block_size=block_size)
    assert res.tokens == want and res.stats.committed == len(want)


def test_a_dynamic_tree_keeps_its_width_and_caches(models, monkeypatch):
    from minispec.drafters import ModelDrafter
    from minispec.tree import DynamicTree, depths
    target, draft = models["target"], models["truncated"]
    prompts = [[1, 2, 3], [7] * 9, [4]]
    seen, propose_tree = [], ModelDrafter.propose_tree

    def watch(self, rows, shapes, contexts, gens, width=None):
        out = propose_tree(self, rows, shapes, contexts, gens, width=width)
        seen.extend(out[1])
        return out

    monkeypatch.setattr(ModelDrafter, "propose_tree", watch)
    res = target.speculate(draft, prompts, tree=DynamicTree(3, 3), max_new_tokens=11, temperature=1.0, seed=3,
                           block_size=4, keep_caches=True, stop_tokens=[])
    assert seen and all(max(map(depths(par).count, set(depths(par))), default=0) <= 3 for par in seen)
    assert any(len(par) == 9 for par in seen)  # full rounds use the whole width at every depth
    # placed where the draft's probabilities say: some depth-1 node gets several children and a sibling none
    assert any(len(set(par[3:6])) < len(par[3:6]) for par in seen)
    for rows in res.caches:
        rows.cache.check_consistency()
        assert not rows.cache.trees
