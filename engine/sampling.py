"""Next-token sampling from float32 logits: pure tensor functions plus a seeded sampler.

Order of filters: the logit bias (`apply_logit_bias`: OpenAI's `logit_bias`, added to the raw
logits, where -100 bans a token and +100 makes the tokens that have it the only candidates),
temperature scaling, top-k, top-p (nucleus, keeps the smallest set whose mass reaches p),
min-p (drops tokens below min_p * p_max), then a draw from the renormalised distribution.
Temperature 0 is greedy argmax (of the biased logits); `argmax_ignoring_eos` is greedy with the
end-of-generation ids masked out, for fixed-length runs.  Ties in argmax go to the lowest id
(`greedy_id`, which takes a host row's argmax through NumPy: torch's took 50 us on a 49,152-id
row and 380 us on a 262,144-id one, NumPy's 4 and 19, the same index).
A `Sampler` also takes a row left on the GPU (engine.device_sampling.DeviceLogits), which
picks on the device with these same filters.
It does not apply repetition penalties or grammars (a grammar masks the row before it gets here).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # None: a fresh random stream
    argmax_ignoring_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs, each bias in [-100, 100] (see `apply_logit_bias`)."""

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for token, bias in self.logit_bias:
            if token < 0 or not (-BIAS_LIMIT <= bias <= BIAS_LIMIT):
                raise ValueError(f"logit_bias needs token ids >= 0 and biases in [-100, 100], got {token}: {bias}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.argmax_ignoring_eos


# OpenAI's bound on a logit bias; a bias at the bound is absolute (a ban, or the only choice).
BIAS_LIMIT = 100.0


def apply_logit_bias(logits: torch.Tensor, bias: tuple[tuple[int, float], ...]) -> torch.Tensor:
    """`logits` (one row, any device) with `bias` applied, as a new float32 tensor: each bias is
    added to its token's logit, except that -100 sets it to -inf and +100 restricts the choice
    to the tokens biased +100 that are still possible (a row masked elsewhere, e.g. by a
    grammar, keeps its mask: a +100 on a masked token is a no-op rather than an empty row).
    Ids past the row are ignored (the server checks them against the vocabulary)."""
    out = logits.float().clone()
    n = out.shape[-1]
    pairs = [(t, b) for t, b in bias if t < n]
    if not pairs:
        return out
    ids = torch.tensor([t for t, _ in pairs], dtype=torch.long, device=out.device)
    values = torch.tensor([b for _, b in pairs], dtype=torch.float32, device=out.device)
    out.index_add_(0, ids, torch.where(values.abs() < BIAS_LIMIT, values, torch.zeros_like(values)))
    banned = ids[values <= -BIAS_LIMIT]
    if banned.numel():
        out.index_fill_(0, banned, float("-inf"))
    forced = ids[values >= BIAS_LIMIT]
    if forced.numel():
        forced = forced[torch.isfinite(out[forced])]
        if forced.numel():
            keep = torch.full_like(out, float("-inf"))
            keep[forced] = out[forced]
            out = keep
    return out


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p (float32, sums to 1)."""
    logits = logits.float()
    scaled = logits / p.temperature
    # A temperature so small that the division overflows (or that is 0 in float32) gives
    # +inf or NaN, and softmax turns that into NaN. Softmax does not change under a shift, so
    # the shifted form (max 0, kept 0 even where 0 / T is NaN) gives the same distribution; it
    # is only taken where needed, so that ordinary rows stay bit-identical.
    shifted = logits - logits.max()
    safe = torch.where(shifted == 0, 0.0, shifted / p.temperature)
    logits = torch.where(torch.isfinite(scaled.max()), scaled, safe)
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of strictly more likely tokens
        drop = torch.zeros_like(probs, dtype=torch.bool)
        drop[idx] = before >= p.top_p
        drop[idx[0]] = False  # the most likely token stays, even for a top_p that is 0 in float32
        probs = probs.masked_fill(drop, 0.0)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def greedy_id(logits: torch.Tensor) -> int:
    """The index of the largest value, as `torch.argmax` gives it: the lowest of tied ones, the
    first NaN if any.  A host row goes through NumPy's vectorised argmax, which agrees on both;
    a row left on the GPU (engine.device_sampling.DeviceLogits) answers for itself."""
    if not isinstance(logits, torch.Tensor):
        return int(logits.argmax())
    if logits.device.type == "cpu" and not logits.requires_grad:
        return int(logits.numpy().argmax())
    return int(torch.argmax(logits))


class Sampler:
    """Draws tokens for one generation; the same seed gives the same stream."""

    def __init__(self, params: SamplingParams, eos_ids: frozenset[int] = frozenset()):
        self.params = params
        self.eos_ids = eos_ids
        self.generator: torch.Generator | None = None
        if not params.greedy:
            self.generator = torch.Generator()
            if params.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor) -> int:
        if not isinstance(logits, torch.Tensor):  # a device row (engine.device_sampling.DeviceLogits)
            return logits.pick(self)
        logits = logits.detach().float().cpu()
        if self.params.logit_bias:
            logits = apply_logit_bias(logits, self.params.logit_bias)
        if self.params.argmax_ignoring_eos:
            best = greedy_id(logits)
            if best in self.eos_ids:  # only then is a masked copy worth its cost
                logits = logits.clone()
                logits[list(self.eos_ids)] = float("-inf")
                best = greedy_id(logits)
            return best
        if self.params.temperature == 0.0:
            return greedy_id(logits)
        probs = filtered_probs(logits, self.params)
        return int(torch.multinomial(probs, 1, generator=self.generator))
