"""Batched sampling where every row has its own temperature, top-k, top-p and random stream.

Each row draws exactly one uniform number per token from its own `random.Random`, and the token is
picked by inverse-CDF over the row's filtered distribution. A seeded request therefore samples the
same tokens whether it runs alone or beside others: its draws never depend on the batch. All
per-token work on the vocabulary is a tensor op over the whole batch.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch


MAX_LOGIT_BIAS = 300
MAX_TOP_LOGPROBS = 20
MIN_REPETITION_PENALTY = 0.01   # logits divided by less overflow float32 (and the penalty means nothing more)
GREEDY_BELOW = 1e-5            # a temperature below this is greedy, its limit (vLLM's _SAMPLING_EPS): dividing
                                # the logits by it would overflow them


class SamplingError(ValueError):
    """Sampling parameters out of range; `param` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param

    def __reduce__(self):       # keeps `param` across the engine process's pipe
        return type(self), (str(self), self.param)


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0      # 0 (or below GREEDY_BELOW) is greedy
    top_k: int | None = None      # None or 0: no top-k filter
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1                    # samples of one prompt, sharing its prefill
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False      # generate max_tokens even past the end of the turn (vLLM's; for benchmarks)
    presence_penalty: float = 0.0     # OpenAI's: subtracted once from every token generated so far
    frequency_penalty: float = 0.0    # OpenAI's: subtracted per occurrence of a token generated so far
    repetition_penalty: float = 1.0   # vLLM's: a token of the prompt or output has its logit divided (> 0) or
                                      # multiplied (< 0) by it
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> added to its logit
    logprobs: int | None = None       # None: none; k: each sampled token's logprob and the k most probable

    @property
    def processes_logits(self) -> bool:
        """Whether the logits of this request's rows need processing before sampling (logits.py)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise SamplingError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k is not None and self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.n < 1:
            raise SamplingError(f"n must be at least 1, got {self.n}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingError("stop strings must be non-empty strings")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise SamplingError(f"{name} must be in [-2, 2], got {getattr(self, name)}", name)
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 10.0:
            raise SamplingError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, 10], got "
                                f"{self.repetition_penalty}", "repetition_penalty")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise SamplingError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}",
                                "logit_bias")
        for tok, bias in self.logit_bias.items():
            if not isinstance(tok, int) or tok < 0:
                raise SamplingError(f"logit_bias keys must be token ids, got {tok!r}", "logit_bias")
            if not -100.0 <= bias <= 100.0:
                raise SamplingError(f"logit_bias values must be in [-100, 100], got {bias} for token {tok}",
                                    "logit_bias")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise SamplingError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}",
                                "top_logprobs")


def row_rng(seed: int | None, sample_index: int) -> random.Random:
    """The random stream of one sample: reproducible for a seed, fresh entropy otherwise."""
    if seed is None:
        return random.Random()
    return random.Random(f"{seed}:{sample_index}")


def sample(logits: torch.Tensor, temperature: list[float], top_k: list[int | None], top_p: list[float],
           uniforms: list[float]) -> torch.Tensor:
    """logits (B, V) -> token ids (B,). One uniform draw per row decides that row's token."""
    B, V = logits.shape
    device = logits.device
    logits = logits.float()
    greedy_rows = [t < GREEDY_BELOW for t in temperature]
    if all(greedy_rows):
        return logits.argmax(dim=-1)
    temp = torch.tensor([1.0 if g else t for g, t in zip(greedy_rows, temperature)], device=device)[:, None]
    scaled = logits / temp
    ks = [k if k else V for k in top_k]
    probs = torch.softmax(scaled, dim=-1)
    if any(k < V for k in ks) or any(p < 1.0 for p in top_p):
        # which tokens each row keeps, found in descending order, then applied as a mask in vocabulary order:
        # a row's draw walks the same order whether or not its batch mates filter
        width = max(ks) if all(p >= 1.0 for p in top_p) else V
        vals, idx = torch.topk(probs, min(width, V), dim=-1)    # sorted, descending
        rank = torch.arange(vals.size(1), device=device)[None, :]
        keep = rank < torch.tensor(ks, device=device)[:, None]
        before = vals.cumsum(dim=-1) - vals                       # mass of the higher-ranked tokens
        keep &= before < torch.tensor(top_p, device=device)[:, None]
        probs = probs * torch.zeros_like(probs, dtype=torch.bool).scatter_(1, idx, keep)
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    u = torch.tensor(uniforms, device=device, dtype=cdf.dtype)[:, None] * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))   # u < total: lands on a kept token
    tokens = torch.searchsorted(cdf, u, right=True).clamp_(max=V - 1)
    tokens = tokens[:, 0]
    if any(greedy_rows):
        greedy = torch.tensor(greedy_rows, device=device)
        tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    return tokens
