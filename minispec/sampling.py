"""Sampling: logits -> the exact distribution sampled from -> a token.

`logits_to_probs` is the single place where temperature, top-k and top-p are applied (in Hugging
Face's order). Speculative decoding calls it on both the draft's and the target's logits, so the
draft's q is exactly the distribution its tokens were drawn from. Temperature 0 (greedy) is the
one-hot distribution on the argmax, which makes the greedy acceptance rule a special case.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import SamplingError, check_logits, check_sampling, check_seed, unsampleable


@dataclass(frozen=True)
class SamplingParams:
    """What shapes the distribution sampled from; the seed is not one of them (generate and speculate take it and
    make the generators: make_generators)."""

    temperature: float = 1.0  # 0 = greedy (argmax); > 0 divides the logits
    top_k: int | None = None  # keep the k most likely tokens; None = all
    top_p: float | None = None  # keep the smallest set whose probability reaches top_p; None = 1.0

    def __post_init__(self):
        check_sampling(self.temperature, self.top_k, self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits (..., V) -> probabilities (..., V) of the distribution that `sample` draws from.

    Raises SamplingError (naming the setting) for a row that cannot be sampled: non-finite logits,
    or a temperature so small that the scaled logits overflow float32. Filtering never empties a
    row: top-k keeps the k largest and top-p the most likely token, whatever their values.
    """
    logits = logits.float()
    check_logits(logits)
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    if unsampleable(logits) is not None:  # finite / tiny overflows to +-inf (and inf - inf is NaN in softmax)
        raise SamplingError(f"temperature={params.temperature!r} is too small: the scaled logits overflow float32; "
                            "use temperature=0 for greedy decoding or a larger temperature")
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the tokens before it already reach top_p; the most likely token always stays
        # (as Hugging Face's min_tokens_to_keep=1: a top_p that rounds to 0 in float32 would drop it)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def make_generators(seed: int | None, n: int, device: torch.device | str = "cpu") -> list[torch.Generator]:
    """One CPU generator per sequence: sequence i of a batch draws from seed + i.

    So sequence i gets the same random stream as a single run with seed + i. Without a seed, the
    streams are seeded from torch's RNG.
    """
    check_seed(seed)
    base = int(torch.randint(0, 2**62, (1,)).item()) if seed is None else seed
    return [torch.Generator(device="cpu").manual_seed(base + i) for i in range(n)]


def sample_rows(probs: torch.Tensor, u: torch.Tensor) -> list[int]:
    """Inverse-CDF draw per row: probs (B, V), u (B,) uniforms in [0, 1) -> B token ids.

    The uniforms are given, so callers such as speculative.verify stay pure functions.
    """
    probs = probs.double().cpu()
    cdf = probs.cumsum(-1)  # (B, V)
    total = cdf[:, -1]
    ok = torch.isfinite(total) & (total > 0) & (probs.amin(-1) >= 0)  # amin: NaN if any is (a tenth of all()'s time)
    if not bool(ok.all()):
        raise SamplingError(f"probability row {int((~ok).nonzero()[0])} has no mass, a NaN or a negative entry: "
                            "nothing can be sampled from it (check the logits and the temperature, top_k and top_p "
                            "settings)")
    x = (u.double().cpu() * total).unsqueeze(-1)  # (B, 1)
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
