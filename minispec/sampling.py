"""Sampling: logits -> the exact distribution sampled from -> a token.

`logits_to_probs` is the single place where temperature, top-k and top-p are
applied. Speculative decoding calls it on both the draft's and the target's
logits, so the draft's q is exactly the distribution its tokens were drawn
from. Temperature 0 (greedy) is the one-hot distribution on the argmax, which
makes the greedy acceptance rule a special case of the sampling rule.
Order of processing follows Hugging Face: temperature, then top-k, then top-p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy (argmax); > 0 divides the logits
    top_k: int | None = None  # keep the k most likely tokens; None = all
    top_p: float | None = None  # keep the smallest set whose probability reaches top_p; None = 1.0
    seed: int | None = None  # seeds the sampling generator; the same seed gives the same tokens

    def __post_init__(self):
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or t != t or t < 0:
            raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {t!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 1):
            raise ValueError(f"top_k must be an integer >= 1 or None, got {self.top_k!r}")
        if self.top_p is not None and (not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] or None, got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits (..., V) -> probabilities (..., V) of the distribution that `sample` draws from."""
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the tokens before it already reach top_p (the top token always stays)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def make_generators(seed: int | None, n: int, device: torch.device | str = "cpu") -> list[torch.Generator]:
    """One generator per sequence: sequence i of a batch draws from seed + i.

    With a seed, sequence i of a batch gets the same random stream as a single
    run with seed + i. Without one, the streams are seeded from torch's RNG.
    """
    base = int(torch.randint(0, 2**62, (1,)).item()) if seed is None else seed
    gens = []
    for i in range(n):
        g = torch.Generator(device="cpu")
        g.manual_seed(base + i)
        gens.append(g)
    return gens


def sample_rows(probs: torch.Tensor, u: torch.Tensor) -> list[int]:
    """Inverse-CDF draw per row: probs (B, V), u (B,) uniforms in [0, 1) -> B token ids.

    The uniforms are given, so callers such as speculative.verify stay pure
    functions, and a batch of rows costs one call.
    """
    probs = probs.double().cpu()
    cdf = probs.cumsum(-1)  # (B, V)
    x = (u.double().cpu() * cdf[:, -1]).unsqueeze(-1)  # (B, 1)
    idx = torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)
    out = idx.tolist()
    for b, i in enumerate(out):
        # rounding can land past the CDF's end on a zero-probability tail token: step back
        while probs[b, i] == 0.0 and i > 0:
            i -= 1
        out[b] = i
    return out


def sample(probs: torch.Tensor, gen: torch.Generator) -> int:
    """Draw one token from a probability vector (V,) with one uniform from `gen`."""
    return sample_rows(probs.unsqueeze(0), torch.rand(1, generator=gen, dtype=torch.float64))[0]
