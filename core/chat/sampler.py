"""Batched sampling where every row has its own temperature, top-k, top-p and random stream.

Each row draws exactly one uniform number per token from its own `random.Random`, and the token is
picked by inverse-CDF over the row's filtered distribution. A seeded request therefore samples the
same tokens whether it runs alone or beside others: its draws never depend on the batch (its stream is
scheduler.row_rng's). All
per-token work on the vocabulary is a tensor op over the whole batch.
"""
from __future__ import annotations

import torch

from .protocol import GREEDY_BELOW


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
