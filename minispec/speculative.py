"""Exact speculative decoding over the paged KV cache: the maths and the batched loop.

After Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding") and Chen et
al. 2023 ("Accelerating Large Language Model Decoding with Speculative Sampling"). The maths is pure
functions (`acceptance`, `residual`, `verify`, `greedy_verify`), `speculate` the loop around them.
One round's six steps, and why the output has the target's law: docs/design.md.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field

import torch

from .adaptive import AUTO_FIXED, AdaptiveK, auto_k, best_k, expected_tokens, fixed_cost_ratio  # noqa: F401
from .drafters import (  # noqa: F401
    CachedRows,
    Drafter,
    ModelDrafter,
    PromptLookupDrafter,
    check_tree_drafter,
    draw_exact,
    make_drafter,
)
from .errors import (
    GenerationError,
    check_callable,
    check_max_new_tokens,
    check_proposal,
    check_seed,
    is_int,
    normalize_prompts,
    resolve_stop_tokens,
    show,
)
from .generate import OnTokens
from .sampling import SamplingParams, logits_to_probs, make_generators, sample_rows
from .tree import AdaptiveTree, DynamicTree, check_tree, check_tree_proposal, depths, fitting, tree_size


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last axis: where the next token comes from after a rejection.

    When p == q the residual has no mass, but then no draft token can be rejected; p is returned so
    the result is always a distribution.
    """
    r = (p.double() - q.double()).clamp_min(0.0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp_min(torch.finfo(torch.float64).tiny), p.double())


def acceptance(p: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For one position: accept probability per drafted token, rejection probability, residual.

    p, q: (..., V) target and draft distributions. Returns accept (..., V) = min(1, p/q) (1 where q = 0:
    such a token is never drafted), reject (...,) = sum max(0, p - q) = P(the draft token is rejected),
    and residual (..., V). The emitted token's distribution is q * accept + reject * residual = p.
    """
    p, q = p.double(), q.double()
    accept = torch.where(q > 0, (p / q.clamp_min(torch.finfo(torch.float64).tiny)).clamp(max=1.0), torch.ones_like(p))
    reject = (p - q).clamp_min(0.0).sum(-1)
    return accept, reject, residual(p, q)


def verify(draft_tokens: list[int], q: torch.Tensor, p: torch.Tensor, uniforms: torch.Tensor) -> tuple[int, int]:
    """The acceptance step of one round for one sequence. Pure: no state, no RNG.

    draft_tokens: d_1..d_k (k >= 0); q: (k, V) the distributions they were drawn from; p: (k+1, V) the
    target's at the same positions plus the bonus position; uniforms: (k+1,) in [0, 1): uniforms[i]
    decides d_{i+1}, uniforms[k] draws the next token. Returns (n_accepted, next_token): the round
    commits d_1..d_n then next_token.
    """
    k = len(draft_tokens)
    if q.shape[0] != k or p.shape[0] != k + 1 or uniforms.shape[0] != k + 1:
        raise ValueError(f"verify needs q ({k}, V), p ({k + 1}, V), uniforms ({k + 1},) for {k} draft tokens; "
                         f"got q {tuple(q.shape)}, p {tuple(p.shape)}, uniforms {tuple(uniforms.shape)}")
    u_next = uniforms[k:k + 1]
    for i, d in enumerate(draft_tokens):
        qd, pd = float(q[i, d]), float(p[i, d])
        if qd <= 0.0:
            raise ValueError(f"draft token {d} at position {i + 1} has q = 0: it cannot have been sampled "
                             "from q; the drafter must return the distribution it drew from")
        if float(uniforms[i]) < pd / qd:  # P(u < r) = min(1, r)
            continue
        return i, sample_rows(residual(p[i], q[i]).unsqueeze(0), u_next)[0]
    return k, sample_rows(p[k].unsqueeze(0), u_next)[0]


# Positions of one row that greedy_verify scores in one lm_head product: a round of k <= 8 drafts (k="auto"'s
# range) in one, since another row of a product costs little beside a second product over the whole head
# (docs/benchmarks.md, "Cost model").
GREEDY_HEAD_CHUNK = 9


@torch.inference_mode()
def greedy_verify(target, h: torch.Tensor, n_pending: list[int], drafts: list[list[int]],
                  chunk: int = GREEDY_HEAD_CHUNK) -> tuple[list[int], list[int]]:
    """Greedy acceptance for a batch from the target's hidden states h (B, T, dim): per row, the number of
    drafts equal to the target's argmax before the first that is not, and the token that follows.

    Position j's logits matter only if drafts 1..j were all accepted, so the lm_head (the largest
    matrix) runs over `chunk` positions at a time, for the rows still in play, and stops early."""
    n_acc, nxt = [0] * len(drafts), [None] * len(drafts)
    for j0 in range(0, max(map(len, drafts)) + 1, chunk):
        rows = [b for b, d in enumerate(drafts) if nxt[b] is None and j0 <= len(d)]
        if not rows:
            break
        where = [(b, j) for b in rows for j in range(j0, min(j0 + chunk, len(drafts[b]) + 1))]
        picks = target.logits(h[[b for b, _ in where], [n_pending[b] - 1 + j for b, j in where]]).argmax(-1).tolist()
        for (b, j), t in zip(where, picks):
            if nxt[b] is not None:  # an earlier position of this row already decided it
                continue
            if j < len(drafts[b]) and drafts[b][j] == t:
                n_acc[b] += 1
            else:
                nxt[b] = t
    return n_acc, nxt


def tree_verify(draft_tokens: list[int], parents: list[int], q: torch.Tensor, p: torch.Tensor,
                uniforms: torch.Tensor, siblings_see_residual: bool = True) -> tuple[list[int], int]:
    """The acceptance step of one tree round for one sequence: recursive rejection sampling down the tree. Pure.

    draft_tokens: the n nodes breadth-first (siblings in the order they were drawn); parents[j]: node j's parent
    (an earlier node, or -1: the root, the last committed token); q: (n, V), q[j] the distribution node j was drawn
    from GIVEN its earlier siblings; p: (n + 1, V), p[0] the target's at the root and p[j + 1] after node j;
    uniforms: (n + 1,), uniforms[j] decides node j and uniforms[n] draws the next token. Returns (path, next_token):
    the accepted nodes root to leaf, then the token after them. A chain (parents -1, 0, 1, ...) is `verify`.

    The walk, at a node whose target distribution is r = p[node]: its children c_1, c_2, ... in order; c_i is
    accepted with probability min(1, r(c_i) / q_i(c_i)), and then the walk moves to c_i (r = p[c_i]); after a
    rejection r becomes the residual norm(max(0, r - q_i)) and the next sibling is tested against it; when every
    child is rejected, the next token is drawn from the last r (for a leaf, which has no children, that is the
    bonus token from p[leaf]).

    Why the output has the target's law (SpecInfer: Miao et al. 2024, multi-step speculative sampling; for draws
    without replacement, Jeon et al. 2024, "Recursive Speculative Decoding"): at each child the step is ordinary
    speculative sampling of one token drawn from q_i against the target r: the token emitted there, by acceptance
    or by whatever follows a rejection, has law r PROVIDED that what follows a rejection emits a token with law
    norm(max(0, r - q_i)). That is exactly what testing the next sibling against that residual does (the same
    argument one level down: c_{i+1} is drawn from q_{i+1} whatever happened to c_1..c_i, so its test is again
    ordinary speculative sampling), and the last residual is sampled directly. By induction over siblings the
    token emitted at a node has law p[node]; by induction over depth (a child's subtree was drawn given the child
    alone) the whole continuation has the target's law. Siblings are drawn without replacement
    (tree.draw_children): q_i is q renormalised without c_1..c_{i-1}, so no two siblings repeat a guess, which is
    what keeps a wide tree useful at low temperature (i.i.d. siblings repeat the draft's favourite, and a repeat of
    a rejected token is rejected surely: the residual has no mass there). Any q_i works, if it is the one c_i was
    drawn from.

    siblings_see_residual=False is the negative control "tree-independent": every sibling tested against r itself,
    the last residual taken against the last sibling's q alone.
    """
    n = len(draft_tokens)
    if q.shape[0] != n or p.shape[0] != n + 1 or uniforms.shape[0] != n + 1 or len(parents) != n:
        raise ValueError(f"tree_verify needs parents ({n},), q ({n}, V), p ({n + 1}, V), uniforms ({n + 1},) for {n} "
                         f"nodes; got {len(parents)}, q {tuple(q.shape)}, p {tuple(p.shape)}, "
                         f"uniforms {tuple(uniforms.shape)}")
    children: dict[int, list[int]] = {}
    for j, par in enumerate(parents):
        children.setdefault(par, []).append(j)
    path, node, r = [], -1, p[0]
    while True:
        for j in children.get(node, []):
            d = draft_tokens[j]
            qd = float(q[j, d])
            if qd <= 0.0:
                raise ValueError(f"draft node {j} (token {d}) has q = 0: it cannot have been sampled from q; the "
                                 "drafter must return the distribution it drew from")
            tested = r if siblings_see_residual else p[node + 1]
            if float(uniforms[j]) < float(tested[d]) / qd:  # P(u < ratio) = min(1, ratio)
                path.append(j)
                node, r = j, p[j + 1]
                break
            r = residual(tested, q[j])
        else:  # every child rejected (or a leaf): the next token from what is left
            return path, sample_rows(r.unsqueeze(0), uniforms[n:n + 1])[0]


def greedy_tree_verify(draft_tokens: list[int], parents: list[int], top: list[int]) -> tuple[list[int], int]:
    """tree_verify at temperature 0: top[j] is the target's argmax at the root (j = 0) and after node j - 1; the
    walk moves to the child equal to it (siblings are distinct) and ends with the first argmax no child matches."""
    path, node = [], -1
    while True:
        nxt = top[node + 1]
        j = next((j for j, (t, par) in enumerate(zip(draft_tokens, parents)) if par == node and t == nxt), None)
        if j is None:
            return path, nxt
        path.append(j)
        node = j


class ExactSampler:
    """The exact algorithm as three steps, so a negative control can replace exactly one of them.

    draw (a model draft's logits -> tokens and the q it reports), target_probs (the target's logits -> the p
    verify is handed), verify (one row at temperature > 0), greedy_verify (a batch at temperature 0),
    tree_verify (a tree round's walk, one row at temperature > 0). minispec.controls registers the broken ones in
    SAMPLERS.
    """

    name = "exact"
    draw = staticmethod(draw_exact)  # the exact steps are the module's pure functions
    target_probs = staticmethod(logits_to_probs)
    verify = staticmethod(verify)
    greedy_verify = staticmethod(greedy_verify)
    tree_verify = staticmethod(tree_verify)


# sampler name -> sampler; minispec.controls adds the negative controls that the exactness tests must reject
SAMPLERS: dict[str, ExactSampler] = {"exact": ExactSampler()}


def get_sampler(sampler: str | ExactSampler) -> ExactSampler:
    """A sampler by name (or the object itself)."""
    if isinstance(sampler, ExactSampler):
        return sampler
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}; got {sampler!r}")
    return SAMPLERS[sampler]


@dataclass
class SpeculativeStats:
    rounds: int = 0  # batched verify passes (one target forward each)
    sequence_rounds: int = 0  # rounds summed over sequences (equals `rounds` for one prompt)
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens the target accepted
    committed: int = 0  # new tokens emitted (accepted + one per round, less any cut at a stop token)
    position_drafted: list[int] = field(default_factory=list)  # [j]: drafts proposed at draft position j+1
    position_accepted: list[int] = field(default_factory=list)  # [j]: of those, accepted
    draft_time_s: float = 0.0  # wall time spent drafting
    verify_time_s: float = 0.0  # wall time in the target's forward and the acceptance step
    k_chosen: list[int] = field(default_factory=list)  # each round's k (with k="auto": the one chosen)
    tree_chosen: list[tuple[int, ...]] = field(default_factory=list)  # with a tree: each round's shape (() plain)

    @property
    def acceptance_rate(self) -> float:
        """Fraction of drafted tokens that were accepted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Tokens committed per round, per sequence (the speedup's numerator)."""
        return self.committed / self.sequence_rounds if self.sequence_rounds else 0.0

    @property
    def position_acceptance(self) -> list[float]:
        """Per draft position j+1: accepted / proposed (decays with j: a rejection ends the round)."""
        return [a / d if d else 0.0 for a, d in zip(self.position_accepted, self.position_drafted)]

    @classmethod
    def combined(cls, stats: list[SpeculativeStats]) -> SpeculativeStats:
        """The stats of several runs as one: counts and times summed, per-position counts added, k's joined."""
        out = cls()
        for st in stats:
            for name in ("rounds", "sequence_rounds", "drafted", "accepted", "committed", "draft_time_s",
                         "verify_time_s"):
                setattr(out, name, getattr(out, name) + getattr(st, name))
            _add_counts(out.position_drafted, st.position_drafted)
            _add_counts(out.position_accepted, st.position_accepted)
            out.k_chosen += st.k_chosen
            out.tree_chosen += st.tree_chosen
        return out

    def _count(self, n_drafted: int, n_accepted: int) -> None:
        _add_counts(self.position_drafted, [1] * n_drafted)
        _add_counts(self.position_accepted, [1] * n_accepted + [0] * (n_drafted - n_accepted))
        self.drafted += n_drafted
        self.accepted += n_accepted
        self.sequence_rounds += 1


def _add_counts(mine: list[int], theirs: list[int]) -> None:
    """mine[j] += theirs[j] for every j, mine first lengthened with zeros to cover theirs."""
    mine.extend([0] * (len(theirs) - len(mine)))
    for j, v in enumerate(theirs):
        mine[j] += v


@dataclass
class SpeculativeResult:
    tokens: list  # list[int] for one prompt, list[list[int]] for a batch: the new tokens only
    stats: SpeculativeStats
    # with keep_caches=True: the target's and the model drafter's CachedRows (cache, seq and pending per row)
    caches: tuple[CachedRows, CachedRows | None] | None = None


@dataclass
class Proposal:
    """One round's drafts, from the propose step: per live row, its draft tokens and the q each was drawn from."""

    rows: list[int]  # the live rows (indices into the prompt batch), in the order of every list here
    k: int  # the round's k, fixed before anything was drafted
    drafts: list[list[int]]  # per row: d_1..d_n (n <= k: a row's budget or the drafter may cut it); a tree's nodes
    qs: list[torch.Tensor]  # per row: (n, V) the distributions the drafts were drawn from
    parents: list[list[int]] | None = None  # a tree round: per row, each node's parent (-1: the root); None: chains


@dataclass
class Verdict:
    """What the verify step decided, per row of a Proposal: the drafts accepted and the token after them."""

    accepted: list[int]  # per row: how many drafts were accepted
    next_tokens: list[int]  # per row: the token drawn after them (the correction, or the bonus token)
    # The target's final hidden states of the verify pass, (rows, T, dim): row b's pass holds its pending tokens
    # then its drafts, so its drafts' states start at index n_pending[b]. A drafter that reads the target's states
    # has had them already, through Drafter.see_hidden; nothing keeps them after the round.
    hidden: torch.Tensor
    n_pending: list[int]  # per row: the tokens fed before its drafts (at least the last committed one)
    paths: list[list[int]] | None = None  # a tree round: per row, the accepted nodes, root to leaf


class _Run:
    """The state one speculate call carries from round to round, and the three steps of a round: propose (the
    drafter's tokens), verify (one target pass and the acceptance step) and commit (outputs, stats, both caches)."""

    def __init__(self, target, drafter: Drafter, policy: ExactSampler, params: SamplingParams, batch, budgets,
                 active, seed, stops, on_tokens, block_size: int, keep_caches: bool, stats: SpeculativeStats,
                 tree: tuple[int, ...] | DynamicTree | None = None):
        self.target, self.drafter, self.policy, self.params, self.tree = target, drafter, policy, params, tree
        self.budgets, self.active, self.stops, self.on_tokens = budgets, active, stops, on_tokens
        self.keep_caches, self.stats = keep_caches, stats
        self.out: list[list[int]] = [[] for _ in batch]
        live_prompts = {i: batch[i] for i in active}
        drafter.start(live_prompts, params, block_size, target.config.vocab_size)
        # the one hook through which a drafter reads the target's features (Drafter.see_hidden): the target's rows
        # report the states of every pass, the prefill's and each verify pass's, as they compute them
        self.tgt = CachedRows(target, live_prompts, block_size, on_hidden=drafter.see_hidden if drafter.reads_hidden
                              else None)
        self.gens = make_generators(seed, len(batch))
        self.contexts = {i: list(batch[i]) for i in active}  # prompt + committed tokens (what prompt lookup searches)

    def propose(self, k: int) -> Proposal:
        """The drafter's tokens for every live row, at most k each and never past a row's remaining budget (a
        round commits at most k + 1 tokens). A tree round: a tree per row, no deeper than the budget allows."""
        room = [self.budgets[i] - len(self.out[i]) - 1 for i in self.active]
        if self.tree is None:
            ks = [min(k, r) for r in room]
            proposal = self.drafter.propose(self.active, ks, self.contexts, self.gens)
            drafts, qs = check_proposal(self.drafter, self.active, ks, proposal, self.target.config.vocab_size)
            return Proposal(list(self.active), k, drafts, qs)
        window = self.target.config.max_seq_len  # the target's cache holds the context and every node
        dynamic = isinstance(self.tree, DynamicTree)
        caps, width = (self.tree.caps, self.tree.width) if dynamic else (self.tree, None)
        shapes = [fitting(caps[:r], window - len(self.contexts[i]), width) for r, i in zip(room, self.active)]
        # a DynamicTree's width goes to the drafter only then: a drafter of fixed shapes need not know of it
        proposal = self.drafter.propose_tree(self.active, shapes, self.contexts, self.gens,
                                             **({"width": width} if dynamic else {}))
        name = type(self.drafter).__name__
        if not (isinstance(proposal, tuple) and len(proposal) == 3):
            raise GenerationError(f"{name}.propose_tree must return (tokens, parents, q)")
        drafts, qs = check_proposal(self.drafter, self.active, [tree_size(sh, width) for sh in shapes],
                                    (proposal[0], proposal[2]), self.target.config.vocab_size)
        parents = [check_tree_proposal(name, i, sh, d, par, width)
                   for i, sh, d, par in zip(self.active, shapes, drafts, proposal[1])]
        return Proposal(list(self.active), len(caps), drafts, qs, parents)

    def verify(self, prop: Proposal) -> Verdict:
        """ONE target pass over every row's pending tokens and drafts, then the acceptance step of each row.

        The pass gives hidden states (B, T, dim); p_1..p_{k+1} of row b come from those at its last pending token
        and at each of its drafts. A tree's nodes are fed with their parents: each attends to the committed tokens
        and its ancestors only, at the position of its depth, so its p is the one a chain along its path gets."""
        drafts, policy, params, trees = prop.drafts, self.policy, self.params, prop.parents
        n_pending = [len(self.tgt.pending[i]) for i in prop.rows]
        h = self.tgt.feed(prop.rows, drafts, hidden=True, parents=trees)
        if params.greedy and trees is None:
            # p is one-hot on the target's argmax, so the exact rule is "accept the drafts while they equal it,
            # then emit it"; greedy_verify skips the lm_head at positions after the first rejection
            return Verdict(*policy.greedy_verify(self.target, h, n_pending, drafts), h, n_pending)
        b_idx = [b for b, d in enumerate(drafts) for _ in range(len(d) + 1)]
        t_idx = [n_pending[b] - 1 + j for b, d in enumerate(drafts) for j in range(len(d) + 1)]
        logits = self.target.logits(h[b_idx, t_idx]).float()
        starts = [0, *itertools.accumulate(len(d) + 1 for d in drafts)]  # row b's rows of logits: (sum k_b + 1, V)
        if params.greedy:  # a tree: the target's argmax at every node, the walk to the child that matches it
            top = logits.argmax(-1).tolist()
            decided = [greedy_tree_verify(d, trees[b], top[starts[b]:starts[b + 1]]) for b, d in enumerate(drafts)]
        else:
            probs = policy.target_probs(logits, params).double().cpu()
            u = [torch.rand(len(d) + 1, generator=self.gens[i], dtype=torch.float64) for d, i in zip(drafts, prop.rows)]
            decided = [policy.verify(drafts[b], prop.qs[b], probs[starts[b]:starts[b + 1]], u[b]) if trees is None else
                       policy.tree_verify(drafts[b], trees[b], prop.qs[b], probs[starts[b]:starts[b + 1]], u[b])
                       for b in range(len(drafts))]
        first, nxt = (list(x) for x in zip(*decided))
        if trees is None:
            return Verdict(first, nxt, h, n_pending)
        return Verdict([len(path) for path in first], nxt, h, n_pending, first)

    def commit(self, prop: Proposal, verdict: Verdict) -> None:
        """Each row's accepted drafts and next token, cut at a stop token or the budget, go to its output, the
        caller's on_tokens, both caches and the stats; a finished row leaves the live rows."""
        still = []
        for b, i in enumerate(prop.rows):
            n, path = verdict.accepted[b], None if verdict.paths is None else verdict.paths[b]
            if path is None:
                self.stats._count(len(prop.drafts[b]), n)
                new = prop.drafts[b][:n] + [verdict.next_tokens[b]]
            else:  # per position: the depths drafted and reached; drafted: every node
                depth = max(depths(prop.parents[b]), default=0)
                self.stats._count(depth, n)
                self.stats.drafted += len(prop.drafts[b]) - depth
                new = [prop.drafts[b][j] for j in path] + [verdict.next_tokens[b]]
            # a stop token inside the accepted run ends the sequence there
            new = new[:next((j for j, t in enumerate(new) if t in self.stops), len(new) - 1) + 1]
            self.out[i] += new
            self.contexts[i] += new
            self.stats.committed += len(new)
            if self.on_tokens is not None:
                self.on_tokens(i, list(new))  # a copy: a callback that edits its list changes nothing here
            self.tgt.commit(i, new, path)
            if path is None:
                self.drafter.commit(i, new)
            else:
                self.drafter.commit(i, new, path)
            if self.out[i][-1] in self.stops or len(self.out[i]) >= self.budgets[i]:
                if not self.keep_caches:
                    self.tgt.free(i)
                self.drafter.finish(i, keep=self.keep_caches)
            else:
                still.append(i)
        self.active = still


_K_UNSET = object()  # speculate's k when the caller gave none: 4, unless a tree is given


@torch.inference_mode()
def speculate(target, draft, prompts, k: int | str | AdaptiveK = _K_UNSET, max_new_tokens: int = 64,
              temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
              stop_tokens=None, on_tokens: OnTokens | None = None, block_size: int = 16,
              sampler: str | ExactSampler = "exact", keep_caches: bool = False,
              tree: tuple[int, ...] | str | DynamicTree | AdaptiveTree | None = None) -> SpeculativeResult:
    """Generate with `target`, `draft` proposing up to k tokens per round (or a tree); exact in distribution.

    draft: a Transformer sharing the target's tokenizer, "prompt-lookup", or a Drafter.
    k: draft tokens per round; "auto" picks k each round from the running acceptance estimate and the
      measured step costs (AdaptiveK; 0 = plain decoding when speculation would not pay), carried over
      from earlier calls with the same draft, sampling settings and batch size (see auto_k): the output's
      distribution is exact, but the tokens of a seed can vary run to run with the timings; "auto-fixed"
      adapts k from the acceptance alone with fixed step costs (fixed_cost_ratio), so a seed always gives
      the same tokens; or an AdaptiveK of your own. Default 4 (without a tree).
    tree: instead of k, a token tree per round: (b_1, ..., b_d) gives every node at depth i - 1 up to b_i children,
      drawn by the draft without replacement (greedy: its top b_i), all scored in one target pass and walked by
      tree_verify (docs/design.md, "A tree round"). A model draft only. A tree.DynamicTree(width, depth): each
      round's shape chosen by the draft, at most `width` nodes a depth placed where its own probabilities say
      the walk will go (EAGLE-2's dynamic trees). "auto": each round a chain or a tree
      of tree.AUTO_SHAPES (or plain decoding), picked from the running acceptance and the measured step costs
      (tree.AdaptiveTree, carried over between calls as k="auto"'s estimates are); or an AdaptiveTree of your own.
    prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_tokens, on_tokens, block_size: as in
      minispec.generate.generate (sequence i samples from seed + i; temperature 0 gives generate's tokens).
    sampler: "exact", or the name of a deliberately broken negative control (minispec.controls describes
      each; SAMPLERS holds every name).
    keep_caches: keep every sequence in both caches and return them in result.caches (for tests).

    Each round is three steps of _Run: propose, verify, commit (docs/design.md, "One speculative round").
    """
    params = SamplingParams(temperature, top_k, top_p)
    check_seed(seed)  # here, before the prefills: the generators are made after them
    check_max_new_tokens(max_new_tokens)
    check_callable("on_tokens", on_tokens, GenerationError)
    policy = get_sampler(sampler)
    if tree is not None:
        if k is not _K_UNSET:
            raise GenerationError("give k (a chain of drafts) or tree (a tree of them), not both")
        tree = tree if tree == "auto" or isinstance(tree, (AdaptiveTree, DynamicTree)) else check_tree(tree)
        k = None
    elif k is _K_UNSET:
        k = 4
    chain_k = k in ("auto", AUTO_FIXED) if isinstance(k, str) else isinstance(k, AdaptiveK) or (is_int(k) and k >= 1)
    if tree is None and not chain_k:
        raise GenerationError(f"k (draft tokens per round) must be an integer >= 1, 'auto', '{AUTO_FIXED}' or an "
                              f"AdaptiveK, got {show(k)}")
    stats = SpeculativeStats()
    drafter = make_drafter(target, draft, policy.draw)
    batch, single = normalize_prompts(target, prompts)
    adaptive = k if isinstance(k, AdaptiveK) else None  # None: a fixed k
    auto_tree = tree if isinstance(tree, AdaptiveTree) else None  # tree="auto" and its like: a shape per round
    check_tree_drafter(drafter, tree)
    if auto_tree is not None or tree == "auto":
        if auto_tree is None:
            auto_tree = auto_k(target, draft, params, len(batch), policy.name, make=AdaptiveTree)
        adaptive, tree = auto_tree, None  # _Run gets each round's shape; a chain's runs as a chain round
    if k == "auto":
        adaptive = auto_k(target, draft, params, len(batch), policy.name)
    elif k == AUTO_FIXED:  # nothing measured or carried over: the same call gives the same k's, so the same tokens
        adaptive = AdaptiveK(cost_ratio=fixed_cost_ratio(target, drafter))
    stops = resolve_stop_tokens(target, stop_tokens)
    max_len = target.config.max_seq_len
    budgets = {i: min(max_new_tokens, max_len - len(p)) for i, p in enumerate(batch)}  # prompt + output <= max_seq_len
    active = [i for i in range(len(batch)) if budgets[i] > 0]
    if not active:
        return SpeculativeResult([] if single else [[] for _ in batch], stats)
    run = _Run(target, drafter, policy, params, batch, budgets, active, seed, stops, on_tokens, block_size,
               keep_caches, stats, tree)
    while run.active:
        if auto_tree is not None:
            shape = auto_tree.choose_tree()
            run.tree, kr = (shape if any(b > 1 for b in shape) else None), len(shape)
        else:
            kr = adaptive.choose() if adaptive else k if tree is None else len(getattr(tree, "caps", tree))
        t0 = time.perf_counter()
        prop = run.propose(kr)
        t1 = time.perf_counter()
        verdict = run.verify(prop)
        run.commit(prop, verdict)
        t2 = time.perf_counter()
        if auto_tree is not None and prop.parents is not None:  # as below: the first round's times do not count
            widths = [math.prod(run.tree[:i]) for i in range(drafter.steps)] if stats.rounds else None
            auto_tree.update_tree(prop.parents, verdict.paths, t1 - t0, widths, (t2 - t1) if stats.rounds else None)
        elif adaptive is not None:  # a call's first round also prefills both models: its outcome counts, its times not
            adaptive.update([len(d) for d in prop.drafts], verdict.accepted, t1 - t0,
                            drafter.steps * (stats.rounds > 0), (t2 - t1) if stats.rounds else None)
        stats.rounds += 1
        stats.k_chosen.append(kr)
        if tree is not None or auto_tree is not None:
            stats.tree_chosen.append(tree if auto_tree is None else shape)
        stats.draft_time_s += t1 - t0
        stats.verify_time_s += t2 - t1
    caches = (run.tgt, getattr(drafter, "rows", None)) if keep_caches else None
    return SpeculativeResult(run.out[0] if single else run.out, stats, caches)
