"""Exact speculative decoding over the paged KV cache: the maths and the batched loop.

After Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding") and Chen et
al. 2023 ("Accelerating Large Language Model Decoding with Speculative Sampling"). The maths is pure
functions (`acceptance`, `residual`, `verify`, `greedy_verify`, `tree_verify`), `decide` the one acceptance step
of a round (greedy or sampled, chain or tree), and `speculate` the loop around them: each round a schedule
chooses (minispec.schedule), the drafter proposes, the target verifies, the round commits, the schedule observes.
The round, and why the output has the target's law: docs/design.md, "One speculative round".
"""

from __future__ import annotations

import itertools
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
    normalize_prompts,
    resolve_stop_tokens,
)
from .generate import OnTokens
from .sampling import SamplingParams, logits_to_probs, make_generators, sample_rows
from .schedule import K_UNSET, Outcome, Plan, check_plan, make_schedule
from .threads import as_caller, decoding_loop
from .tree import AdaptiveTree, DynamicTree, chain, check_tree_proposal, depths, fitting, tree_size


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
    """The exact algorithm as its steps, so a negative control can replace exactly one of them.

    draw (a model draft's logits -> tokens and the q it reports), target_probs (the target's logits -> the p
    verify is handed), verify (one row at temperature > 0), greedy_verify (a batch at temperature 0),
    tree_verify (a tree round's walk, one row at temperature > 0); `decide` is the one caller of the last four.
    minispec.controls registers the broken ones in SAMPLERS.
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
    position_drafted: list[int] = field(default_factory=list)  # [j]: rows that drafted to depth j+1 (a chain: position)
    position_accepted: list[int] = field(default_factory=list)  # [j]: of those, accepted to depth j+1
    draft_time_s: float = 0.0  # wall time spent drafting
    verify_time_s: float = 0.0  # wall time in the target's forward, the acceptance step and the commit
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

    def record_row(self, parents: list[int], n_accepted: int, n_committed: int = 0) -> None:
        """One row's round: its drafts' parents (a chain's: tree.chain(k)), how many the walk accepted (a path from
        the root, so a depth) and the tokens it committed. Per position: the depths drafted and reached."""
        depth = max(depths(parents), default=0)
        _add_counts(self.position_drafted, [1] * depth)
        _add_counts(self.position_accepted, [1] * n_accepted + [0] * (depth - n_accepted))
        self.drafted += len(parents)
        self.accepted += n_accepted
        self.committed += n_committed
        self.sequence_rounds += 1

    def record_round(self, plan: Plan, draft_s: float, verify_s: float) -> None:
        """One batched round: its plan and its wall times."""
        self.rounds += 1
        self.k_chosen.append(plan.k)
        if plan.shape is not None:
            self.tree_chosen.append(plan.shape)
        self.draft_time_s += draft_s
        self.verify_time_s += verify_s


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
    """One round's drafts, from the propose step: per live row, its draft tokens, their parents and the q each was
    drawn from. A chain is the tree whose parents are [-1, 0, 1, ...]."""

    rows: list[int]  # the live rows (indices into the prompt batch), in the order of every list here
    drafts: list[list[int]]  # per row: its draft tokens (a tree's nodes breadth-first); a budget may cut them
    qs: list[torch.Tensor]  # per row: (n, V) the distributions the drafts were drawn from
    parents: list[list[int]]  # per row: each draft's parent (-1: the root, the last committed token)
    tree: bool = False  # a tree round (drafted as a tree, fed with parents, walked); False: a chain round


@dataclass
class Verdict:
    """What the verify step decided, per row of a Proposal: the drafts accepted and the token after them."""

    paths: list[list[int]]  # per row: the accepted drafts, root to leaf (a chain's: 0, 1, ..., n - 1)
    next_tokens: list[int]  # per row: the token drawn after them (the correction, or the bonus token)

    @property
    def accepted(self) -> list[int]:
        """Per row: how many drafts were accepted."""
        return [len(p) for p in self.paths]


def decide(policy: ExactSampler, target, params: SamplingParams, prop: Proposal, h: torch.Tensor,
           n_pending: list[int], gens: list) -> Verdict:
    """The acceptance step of one round for every row, from the verify pass's hidden states h (rows, T, dim): row
    b's p_1..p_{k+1} come from its last pending token (index n_pending[b] - 1) and each of its drafts.

    Greedy or sampled, chain or tree, here alone: a greedy chain by policy.greedy_verify (the lm_head stops at the
    first rejection); otherwise the logits of every row's positions in one product, then per row the argmax walk
    (greedy_tree_verify) or, sampled, policy.verify (a chain) or policy.tree_verify (a tree) with the row's
    uniforms, drawn from its generator after its drafts."""
    drafts = prop.drafts
    if params.greedy and not prop.tree:
        # p is one-hot on the target's argmax, so the exact rule is "accept the drafts while they equal it,
        # then emit it"; greedy_verify skips the lm_head at positions after the first rejection
        n_acc, nxt = policy.greedy_verify(target, h, n_pending, drafts)
        return Verdict([list(range(n)) for n in n_acc], nxt)
    b_idx = [b for b, d in enumerate(drafts) for _ in range(len(d) + 1)]
    t_idx = [n_pending[b] - 1 + j for b, d in enumerate(drafts) for j in range(len(d) + 1)]
    logits = target.logits(h[b_idx, t_idx]).float()
    rows = list(itertools.pairwise([0, *itertools.accumulate(len(d) + 1 for d in drafts)]))  # row b's logits
    if params.greedy:  # a tree: the target's argmax at every node, the walk to the child that matches it
        top = logits.argmax(-1).tolist()
        decided = [greedy_tree_verify(d, par, top[i:j]) for d, par, (i, j) in zip(drafts, prop.parents, rows)]
        return Verdict([path for path, _ in decided], [nxt for _, nxt in decided])
    probs = policy.target_probs(logits, params).double().cpu()
    u = [torch.rand(len(d) + 1, generator=gens[r], dtype=torch.float64) for d, r in zip(drafts, prop.rows)]
    paths, nxt = [], []
    for d, par, q, (i, j), ub in zip(drafts, prop.parents, prop.qs, rows, u):
        if prop.tree:
            path, t = policy.tree_verify(d, par, q, probs[i:j], ub)
        else:
            n, t = policy.verify(d, q, probs[i:j], ub)
            path = list(range(n))
        paths.append(path)
        nxt.append(t)
    return Verdict(paths, nxt)


class _Run:
    """What one speculate call carries from round to round, and a round's steps: propose (the drafter's tokens),
    verify (one target pass and the acceptance step) and commit (outputs, stats, both caches)."""

    def __init__(self, target, draft, prompts, k, tree, params: SamplingParams, seed, max_new_tokens, stop_tokens,
                 on_tokens: OnTokens | None, block_size: int, sampler, keep_caches: bool):
        check_seed(seed)  # here, before the prefills: the generators are made after them
        check_max_new_tokens(max_new_tokens)
        check_callable("on_tokens", on_tokens, GenerationError)
        self.policy = get_sampler(sampler)
        k, tree = check_plan(k, tree)
        self.drafter = make_drafter(target, draft, self.policy.draw)
        batch, self.single = normalize_prompts(target, prompts)
        check_tree_drafter(self.drafter, tree)
        self.schedule = make_schedule(k, tree, target, draft, self.drafter, params, len(batch), self.policy.name)
        self.stops = resolve_stop_tokens(target, stop_tokens)
        self.target, self.params, self.on_tokens, self.keep_caches = target, params, on_tokens, keep_caches
        max_len = target.config.max_seq_len
        # prompt + output <= max_seq_len
        self.budgets = {i: min(max_new_tokens, max_len - len(p)) for i, p in enumerate(batch)}
        self.active = [i for i in range(len(batch)) if self.budgets[i] > 0]
        self.out: list[list[int]] = [[] for _ in batch]
        self.stats, self.tgt = SpeculativeStats(), None
        if self.active:  # nothing to generate: no prefill
            self._start(batch, seed, block_size)

    def _start(self, batch, seed, block_size: int) -> None:
        """Both models' prefills and each row's generator."""
        live_prompts = {i: batch[i] for i in self.active}
        self.drafter.start(live_prompts, self.params, block_size, self.target.config.vocab_size)
        # the one hook through which a drafter reads the target's features (Drafter.see_hidden): the target's rows
        # report the states of every pass, the prefill's and each verify pass's, as they compute them
        self.tgt = CachedRows(self.target, live_prompts, block_size,
                              on_hidden=self.drafter.see_hidden if self.drafter.reads_hidden else None)
        self.gens = make_generators(seed, len(batch))
        self.contexts = {i: list(batch[i]) for i in self.active}  # prompt + committed tokens (prompt lookup's)

    def propose(self, plan: Plan) -> Proposal:
        """The drafter's tokens for every live row, at most plan.k each and never past a row's remaining budget (a
        round commits at most k + 1 tokens). A tree round: a tree per row, no deeper than the budget allows."""
        room = [self.budgets[i] - len(self.out[i]) - 1 for i in self.active]
        vocab = self.target.config.vocab_size
        if plan.tree is None:
            ks = [min(plan.k, r) for r in room]
            proposal = self.drafter.propose(self.active, ks, self.contexts, self.gens)
            drafts, qs = check_proposal(self.drafter, self.active, ks, proposal, vocab)
            return Proposal(list(self.active), drafts, qs, [chain(len(d)) for d in drafts])
        window = self.target.config.max_seq_len  # the target's cache holds the context and every node
        dynamic = isinstance(plan.tree, DynamicTree)
        caps, width = (plan.tree.caps, plan.tree.width) if dynamic else (plan.tree, None)
        shapes = [fitting(caps[:r], window - len(self.contexts[i]), width) for r, i in zip(room, self.active)]
        # a DynamicTree's width goes to the drafter only then: a drafter of fixed shapes need not know of it
        proposal = self.drafter.propose_tree(self.active, shapes, self.contexts, self.gens,
                                             **({"width": width} if dynamic else {}))
        name = type(self.drafter).__name__
        if not (isinstance(proposal, tuple) and len(proposal) == 3):
            raise GenerationError(f"{name}.propose_tree must return (tokens, parents, q)")
        drafts, qs = check_proposal(self.drafter, self.active, [tree_size(sh, width) for sh in shapes],
                                    (proposal[0], proposal[2]), vocab)
        parents = [check_tree_proposal(name, i, sh, d, par, width)
                   for i, sh, d, par in zip(self.active, shapes, drafts, proposal[1])]
        return Proposal(list(self.active), drafts, qs, parents, tree=True)

    def verify(self, prop: Proposal) -> Verdict:
        """ONE target pass over every row's pending tokens and drafts, then the acceptance step (decide). A tree's
        nodes are fed with their parents: each attends to the committed tokens and its ancestors only, at the
        position of its depth, so its p is the one a chain along its path gets. A chain is fed as a chain."""
        n_pending = [len(self.tgt.pending[i]) for i in prop.rows]
        h = self.tgt.feed(prop.rows, prop.drafts, hidden=True, parents=prop.parents if prop.tree else None)
        return decide(self.policy, self.target, self.params, prop, h, n_pending, self.gens)

    def commit(self, prop: Proposal, verdict: Verdict) -> None:
        """Each row's accepted drafts and next token, cut at a stop token or the budget, go to its output, the
        caller's on_tokens, both caches and the stats; a finished row leaves the live rows."""
        still = []
        for b, i in enumerate(prop.rows):
            path = verdict.paths[b]
            new = [prop.drafts[b][j] for j in path] + [verdict.next_tokens[b]]
            # a stop token inside the accepted run ends the sequence there
            new = new[:next((j for j, t in enumerate(new) if t in self.stops), len(new) - 1) + 1]
            self.out[i] += new
            self.contexts[i] += new
            self.stats.record_row(prop.parents[b], len(path), len(new))
            if self.on_tokens is not None:
                as_caller(self.on_tokens, i, list(new))  # a copy: a callback that edits its list changes nothing here
            # a chain's caches roll back to what agrees; a tree's first keep the path (a chain drafter knows no path)
            self.tgt.commit(i, new, path if prop.tree else None)
            self.drafter.commit(i, new, path) if prop.tree else self.drafter.commit(i, new)
            if self.out[i][-1] in self.stops or len(self.out[i]) >= self.budgets[i]:
                if not self.keep_caches:
                    self.tgt.free(i)
                self.drafter.finish(i, keep=self.keep_caches)
            else:
                still.append(i)
        self.active = still

    def outcome(self, plan: Plan, prop: Proposal, verdict: Verdict, draft_s: float, verify_s: float) -> Outcome:
        """The round as its schedule observes it."""
        return Outcome(plan, prop.parents, verdict.paths, draft_s, verify_s, self.drafter.steps, self.stats.rounds > 0)

    def result(self) -> SpeculativeResult:
        caches = (self.tgt, getattr(self.drafter, "rows", None)) if self.keep_caches and self.tgt else None
        return SpeculativeResult(self.out[0] if self.single else self.out, self.stats, caches)


@torch.inference_mode()
def speculate(target, draft, prompts, k: int | str | AdaptiveK = K_UNSET, max_new_tokens: int = 64,
              temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
              stop_tokens=None, on_tokens: OnTokens | None = None, block_size: int = 16,
              sampler: str | ExactSampler = "exact", keep_caches: bool = False,
              tree: tuple[int, ...] | str | DynamicTree | AdaptiveTree | None = None) -> SpeculativeResult:
    """Generate with `target`, `draft` proposing up to k tokens per round (or a tree); exact in distribution.

    draft: a Transformer sharing the target's tokenizer, "prompt-lookup", or a Drafter.
    k: draft tokens per round (default 4); "auto" picks each round's k from the running acceptance and the measured
      step costs (an AdaptiveK carried over between calls: exact, but a seed's tokens vary with the timings);
      "auto-fixed" from the acceptance and the configs alone (a seed's tokens fixed); or an AdaptiveK of your own.
    tree: instead of k, a tree per round (a model draft only; docs/design.md, "A tree round"): (b_1, ..., b_d), up
      to b_i children per node at depth i - 1; a tree.DynamicTree(width, depth), placed by the draft each round;
      "auto" (or a tree.AdaptiveTree): each round a chain, a tree of tree.AUTO_SHAPES or plain decoding.
    prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_tokens, on_tokens, block_size: as in
      minispec.generate.generate (sequence i samples from seed + i; temperature 0 gives generate's tokens).
    sampler: "exact", or a deliberately broken negative control (minispec.controls; SAMPLERS holds every name).
    keep_caches: keep every sequence in both caches and return them in result.caches (for tests).

    Each round: the schedule chooses, the drafter proposes, the target verifies, the round commits, the schedule
    observes (minispec.schedule; docs/design.md, "One speculative round")."""
    with decoding_loop():  # PyTorch at one thread between the steps
        run = _Run(target, draft, prompts, k, tree, SamplingParams(temperature, top_k, top_p), seed, max_new_tokens,
                   stop_tokens, on_tokens, block_size, sampler, keep_caches)
        while run.active:
            plan = run.schedule.choose()
            t0 = time.perf_counter()
            prop = run.propose(plan)
            t1 = time.perf_counter()
            verdict = run.verify(prop)
            run.commit(prop, verdict)
            t2 = time.perf_counter()
            run.schedule.observe(run.outcome(plan, prop, verdict, t1 - t0, t2 - t1))  # before the round is counted
            run.stats.record_round(plan, t1 - t0, t2 - t1)
        return run.result()
