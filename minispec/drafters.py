"""Drafters: what proposes the tokens that the target verifies (the `Drafter` protocol).

`ModelDrafter`: a smaller Transformer sharing the target's tokenizer samples d_1..d_k over its own paged
cache. `PromptLookupDrafter`: model-free, the n-gram that followed the last tokens earlier in the context
(Saxena 2023), q one-hot on it. `CachedRows` (the target's and a model draft's): one cache row per sequence."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .errors import GenerationError, check_compatible, check_int
from .passes import keep_path
from .sampling import SamplingParams, logits_to_probs, sample_rows
from .tree import AdaptiveTree, allocate, draw_children, fitting, top_children, tree_text

PROMPT_LOOKUP = "prompt-lookup"  # the name that selects PromptLookupDrafter


class CachedRows:
    """A model, its paged cache, and one cache sequence per batch row.

    Between rounds a row's cache holds its committed tokens except `pending` ones; at least the last
    committed token stays pending, because feeding it is what yields the next position's logits. Rows
    that share a prompt share its prefill: it runs once and the blocks are forked (copy-on-write).

    on_hidden(rows, states): given, every pass (the prefill and each feed) also reports the model's final hidden
    states for the tokens it was fed, per row (see Drafter.see_hidden): how speculate hands a drafter the target's.
    """

    def __init__(self, model, prompts: dict[int, list[int]], block_size: int, on_hidden: Callable | None = None):
        self.model, self.on_hidden = model, on_hidden
        unique: dict[tuple, list[int]] = {}
        for row, p in prompts.items():
            unique.setdefault(tuple(p), []).append(row)
        self.cache = model.new_cache(block_size=block_size)  # grows by blocks as the rows do
        self.seq: dict[int, int] = {}
        self.pending: dict[int, list[int]] = {r: [p[-1]] for r, p in prompts.items()}
        self.fed: dict[int, list[int]] = {}  # row -> tokens fed after its pending ones this round
        parents = {p: self.cache.new_sequence() for p in unique if len(p) > 1}
        if parents:  # one prefill of prompt[:-1] per distinct prompt
            h = model.step(self.cache, list(parents.values()), [list(p[:-1]) for p in parents],
                           hidden=on_hidden is not None)
            if on_hidden is not None:
                of = {p: h[b, :len(p) - 1] for b, p in enumerate(parents)}
                rows = [r for p, rs in unique.items() if p in of for r in rs]
                on_hidden(rows, [of[tuple(prompts[r])] for r in rows])
        for p, rows in unique.items():
            for r in rows:
                self.seq[r] = self.cache.fork(parents[p]) if p in parents else self.cache.new_sequence()
        for s in parents.values():
            self.cache.free(s)

    def feed(self, rows: list[int], tokens: list[list[int]], all_logits: bool = False,
             hidden: bool = False, parents: list[list[int]] | None = None) -> torch.Tensor:
        """Append each row's pending tokens (first feed of a round only) and then tokens[j]; return the logits
        (or the hidden states: see Transformer.step). parents (a tree round): per row, each token's parent among
        the tokens fed this round (an index into them, -1: the last committed token); None: a chain."""
        tree = None if parents is None else [self._in_sequence(r, p) for r, p in zip(rows, parents)]
        lists = []
        for r, t in zip(rows, tokens):
            lists.append(self.pending[r] + t)
            self.pending[r] = []
            self.fed.setdefault(r, []).extend(t)
        seqs = [self.seq[r] for r in rows]
        if self.on_hidden is None:
            return self.model.step(self.cache, seqs, lists, all_logits=all_logits, hidden=hidden, parents=tree)
        h = self.model.step(self.cache, seqs, lists, hidden=True, parents=tree)
        self.on_hidden(rows, [h[b, :len(t)] for b, t in enumerate(lists)])
        if hidden:
            return h
        if all_logits:
            return self.model.logits(h).float()
        return self.model.logits(h[torch.arange(len(rows)), torch.tensor([len(t) - 1 for t in lists])]).float()

    def _in_sequence(self, row: int, parents: list[int]) -> list[int]:
        """A tree feed's parents as indices in the row's cache sequence, its pending tokens (a chain) first."""
        start, pending = self.cache.length(self.seq[row]), len(self.pending[row])
        root = start + pending - 1 - len(self.fed.get(row, []))  # the last committed token
        return [start + i - 1 for i in range(pending)] + [root if p < 0 else root + 1 + p for p in parents]

    def commit(self, row: int, new_tokens: list[int], path: list[int] | None = None) -> None:
        """The round committed new_tokens: keep the fed tokens that agree with them, roll back the rest. path (a
        tree round): the accepted nodes, indices into the tokens fed this round; the cache keeps those it was fed
        (passes.keep_path) and drops their siblings first."""
        fed = self.fed.pop(row, None)
        if fed is None:  # not fed this round: everything committed is still to be fed
            self.pending[row] += new_tokens
            return
        if path is not None:
            s = self.seq[row]
            root = self.cache.length(s) - len(fed) - 1
            kept = [j for j in path if j < len(fed)]  # a prefix of the path: a draft is never fed its last depth
            keep_path(self.cache, s, root + 1, [root + 1 + j for j in kept])
            fed = [fed[j] for j in kept]
        keep = 0
        while keep < min(len(fed), len(new_tokens) - 1) and fed[keep] == new_tokens[keep]:
            keep += 1
        s = self.seq[row]
        self.cache.truncate(s, self.cache.length(s) - len(fed) + keep)
        self.pending[row] = new_tokens[keep:]

    def free(self, row: int) -> None:
        self.cache.free(self.seq[row])


def one_hot(tokens: list[int], vocab_size: int) -> torch.Tensor:
    """(len(tokens), V) float64 rows, each 1 at its token: the q of a deterministic proposal."""
    q = torch.zeros(len(tokens), vocab_size, dtype=torch.float64)
    q[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)] = 1.0
    return q


class Drafter:
    """What `speculate` asks of a drafter. Rows are indices into the prompt batch.

    start(prompts, params, block_size, vocab_size): a new run; prompts is a dict by row.
    propose(rows, ks, contexts, gens) -> (tokens, q): for each rows[j], up to ks[j] tokens and the
        (n_j, V) float64 distributions they were drawn from; contexts[row] is prompt + committed tokens;
        gens[row] is the row's generator (a drafter that samples must draw only from it).
    commit(row, tokens): the round committed these tokens to the row.
    propose_tree(rows, shapes, contexts, gens) -> (tokens, parents, q): a tree round's (speculate's `tree`): for
        each rows[j] a tree of shape shapes[j] (minispec.tree): its nodes breadth-first, each one's parent (-1: the
        last committed token), the distributions each was drawn from given its earlier siblings; the round's
        commit(row, tokens, path) then names the accepted nodes. A drafter without it drafts chains only.
    finish(row, keep): the row is done; release it unless keep.
    steps: the draft forward passes the last propose() ran (what k="auto" divides its time by).
    reads_hidden, see_hidden(rows, states): the one hook through which a drafter reads the target's features.
        A drafter with reads_hidden True is handed the target's final (normed) hidden states for the tokens
        the target was just fed: once for the prompt's prefill (every prompt token but the last), then after
        each verify pass (the row's pending tokens, then its drafts), before commit(); states[j] is a
        (n_j, dim) tensor for rows[j], in position order, the state at position i predicting token i+1.
        Those of rejected drafts are the drafter's to drop at commit(). They cost no extra target work.
    """

    steps = 0
    reads_hidden = False

    def see_hidden(self, rows, states) -> None:
        pass

    def start(self, prompts, params, block_size, vocab_size) -> None:
        raise NotImplementedError

    def propose(self, rows, ks, contexts, gens):
        raise NotImplementedError

    def commit(self, row: int, tokens: list[int]) -> None:
        pass

    def propose_tree(self, rows, shapes, contexts, gens):
        raise GenerationError(f"{type(self).__name__} drafts chains only: pass k, or a model draft for a tree")

    def finish(self, row: int, keep: bool = False) -> None:
        pass


# (logits (B, V), probs (B, V) = logits_to_probs(logits), uniforms (B,)) -> (B tokens, (B, V) q reported)
Draw = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], "tuple[list[int], torch.Tensor]"]


def draw_exact(logits: torch.Tensor, probs: torch.Tensor, u: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """A model draft's draw: each row's token from its processed distribution, which is the q reported."""
    return sample_rows(probs, u), probs


def draw_step(logits: torch.Tensor, params: SamplingParams, gens: list, draw: Draw = draw_exact):
    """One draft step for a batch: logits (B, V) -> (B tokens, (B, V) q), or (argmaxes, None) when greedy (q is
    then one-hot on them). Each row's uniform comes from its own generator, gens[b]."""
    if params.greedy:
        return logits.argmax(-1).tolist(), None
    probs = logits_to_probs(logits, params).double().cpu()  # (B, V)
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in gens])
    return draw(logits, probs, u)


def add_picks(live: list[int], picks: list[int], q: torch.Tensor | None, tokens: dict, qs: dict) -> None:
    """A draft step's picks (and their q rows, unless greedy) appended to each live row's tokens and qs."""
    for b, (r, d) in enumerate(zip(live, picks)):
        tokens[r].append(d)
        if q is not None:
            qs[r].append(q[b])


def as_proposal(rows: list[int], tokens: dict, qs: dict, vocab_size: int) -> tuple[list, list]:
    """Per-row drafts and q rows -> what propose() returns (q one-hot on the tokens where drafting was greedy)."""
    return ([tokens[r] for r in rows],
            [torch.stack(qs[r]) if qs[r] else one_hot(tokens[r], vocab_size) for r in rows])


class ModelDrafter(Drafter):
    """A smaller Transformer samples d_1..d_k autoregressively over its own paged cache.

    Each step draws from the draft's logits through the same `logits_to_probs` as the target's (so q
    has the same temperature, top-k and top-p); `draw` is that step, replaceable only so the negative
    controls (minispec.controls) can break it. Greedy drafting proposes the argmax, q one-hot on it.
    """

    def __init__(self, model, draw: Draw = draw_exact):
        self.model = model
        self.draw = draw
        self.rows: CachedRows | None = None

    def start(self, prompts, params: SamplingParams, block_size, vocab_size) -> None:
        self.params = params
        self.max_len = self.model.config.max_seq_len
        # a prompt longer than the draft's window never gets drafts: those rounds are plain target steps
        fits = {r: p for r, p in prompts.items() if len(p) <= self.max_len}
        self.rows = CachedRows(self.model, fits, block_size)

    def propose(self, rows, ks, contexts, gens):
        tokens, qs = {r: [] for r in rows}, {r: [] for r in rows}
        # the draft cache holds committed + k - 1 tokens once d_1..d_{k-1} are fed
        ks = {r: min(kk, self.max_len - len(contexts[r]) + 1) if r in self.rows.seq else 0 for r, kk in zip(rows, ks)}
        self.steps = max(ks.values(), default=0)
        for j in range(self.steps):
            live = [r for r in rows if ks[r] > j]
            logits = self.rows.feed(live, [tokens[r][-1:] for r in live])  # j = 0 feeds only the pending tokens
            add_picks(live, *draw_step(logits, self.params, [gens[r] for r in live], self.draw), tokens, qs)
        return as_proposal(rows, tokens, qs, self.model.config.vocab_size)

    def propose_tree(self, rows, shapes, contexts, gens, width: int | None = None):
        """One draft pass per depth, over the nodes of the depth before (the first: the pending tokens); every
        node's children drawn without replacement (tree.draw_children), or its top b_i when greedy (q one-hot).
        With a width (a DynamicTree): at most that many nodes a depth, placed by tree.allocate before they are
        drawn, a node's path value the product of the draft's probabilities of its tokens (greedy: of its softmax)."""
        V = self.model.config.vocab_size
        nodes = {r: ([], [], []) for r in rows}  # row -> tokens, parents, q
        value = {r: [] for r in rows}  # row -> each node's path value (a DynamicTree's allocation reads them)
        # the draft's cache holds the context and every node but the last depth's: they must fit its window
        depth = {r: min(len(sh), len(fitting(sh, self.max_len - len(contexts[r]), width)) + 1)
                 if r in self.rows.seq and len(contexts[r]) <= self.max_len else 0 for r, sh in zip(rows, shapes)}
        frontier = {r: [-1] for r in rows}  # the nodes whose children the next pass draws (-1: the root)
        shape = dict(zip(rows, shapes))
        self.steps = max(depth.values(), default=0)
        for i in range(self.steps):
            live = [r for r in rows if depth[r] > i and frontier[r]]
            if not live:
                self.steps = i
                break
            if i == 0:  # the pending tokens: the root's logits, (B, 1, V)
                logits = self.rows.feed(live, [[] for _ in live]).unsqueeze(1)
            else:
                logits = self.rows.feed(live, [[nodes[r][0][j] for j in frontier[r]] for r in live], all_logits=True,
                                        parents=[[nodes[r][1][j] for j in frontier[r]] for r in live])
            probs = None if self.params.greedy else logits_to_probs(logits, self.params).double().cpu()
            for b, r in enumerate(live):
                tokens, parents, qs = nodes[r]
                n = len(frontier[r])
                dist = (logits[b, :n].float().softmax(-1) if probs is None else probs[b, :n]) if width else None
                counts = ([shape[r][i]] * n if width is None else
                          allocate([1.0 if f < 0 else value[r][f] for f in frontier[r]], dist, shape[r][i], width))
                grown = []
                for m, (f, c) in enumerate(zip(frontier[r], counts)):
                    if c == 0:
                        continue
                    if probs is None:
                        kids = top_children(logits[b, m], c)
                        kq = list(one_hot(kids, V))
                    else:
                        kids, kq = draw_children(probs[b, m], c, torch.rand(c, generator=gens[r], dtype=torch.float64))
                    if width:
                        base = 1.0 if f < 0 else value[r][f]
                        value[r] += [base * float(dist[m, t]) for t in kids]
                    grown += range(len(tokens), len(tokens) + len(kids))
                    tokens += kids
                    parents += [f] * len(kids)
                    qs += kq
                frontier[r] = grown
        return ([nodes[r][0] for r in rows], [nodes[r][1] for r in rows],
                [torch.stack(nodes[r][2]) if nodes[r][2] else torch.zeros(0, V, dtype=torch.float64) for r in rows])

    def commit(self, row, tokens, path=None):
        if row in self.rows.seq:
            self.rows.commit(row, tokens, path)

    def finish(self, row, keep=False):
        if row in self.rows.seq and not keep:
            self.rows.free(row)


class PromptLookupDrafter(Drafter):
    """Model-free drafting: find the sequence's last n tokens earlier in its own context, propose what followed.

    Tries n = ngram down to min_ngram, most recent match first. The proposal is a function of the context,
    so q is one-hot on it and the exact rule applies at any temperature. No match: no draft.
    """

    def __init__(self, ngram: int = 3, min_ngram: int = 1):
        self.ngram = check_int("ngram", ngram, 1)
        self.min_ngram = check_int("min_ngram", min_ngram, 1, ngram)

    def start(self, prompts, params, block_size, vocab_size) -> None:
        self.vocab_size = vocab_size

    def lookup(self, context: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the context's tail."""
        L = len(context)
        for n in range(min(self.ngram, L - 1), self.min_ngram - 1, -1):
            tail = context[L - n:]
            for s in range(L - n - 1, -1, -1):  # starts before the tail itself, so a continuation exists
                if context[s:s + n] == tail:
                    return context[s + n:s + n + k]
        return []

    def propose(self, rows, ks, contexts, gens):
        tokens = [self.lookup(contexts[r], kk) if kk > 0 else [] for r, kk in zip(rows, ks)]
        self.steps = 0
        return tokens, [one_hot(t, self.vocab_size) for t in tokens]


def check_tree_drafter(drafter: Drafter, tree) -> None:
    """A tree (fixed, WxD, "auto" or an AdaptiveTree) needs a drafter that drafts trees: one that drafts chains only
    is refused before any work (a WxD tree would otherwise reach its propose_tree with a width it does not take)."""
    if tree is not None and type(drafter).propose_tree is Drafter.propose_tree:
        what = "'auto'" if tree == "auto" or isinstance(tree, AdaptiveTree) else tree_text(tree)
        raise GenerationError(f"tree={what} needs a drafter that drafts trees (a model draft); "
                              f"{type(drafter).__name__} drafts chains only: pass k")


def make_drafter(target, draft, draw: Draw = draw_exact) -> Drafter:
    """A Transformer, "prompt-lookup", or a Drafter -> a Drafter (a Transformer drafts with `draw`).

    The one check of what may draft for `target` (speculate's, the harness's): a GenerationError says what is
    wrong, before any model work."""
    if isinstance(draft, str):
        if draft != PROMPT_LOOKUP:
            raise GenerationError(f"unknown drafter {draft!r}; pass a Transformer, 'prompt-lookup' or a Drafter")
        return PromptLookupDrafter()
    if isinstance(draft, ModelDrafter):
        draft = draft.model
    elif isinstance(draft, Drafter):
        return draft
    if not (hasattr(draft, "step") and hasattr(draft, "config")):
        raise GenerationError(f"draft must be a Transformer, 'prompt-lookup' or a Drafter, got {type(draft).__name__}")
    check_compatible(target, draft)
    return ModelDrafter(draft, draw)
