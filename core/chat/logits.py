"""Per-row logit processing the engine applies before sampling: logit_bias and penalties, and log-probabilities.

Only the rows whose requests ask for them pay anything: the engine passes their cache rows, and every
operation here is one tensor op over those rows. State lives in buffers indexed by cache row, allocated the
first time a request needs them:

- counts (rows, vocab): how often each token was generated so far in the row (frequency/presence penalties);
- seen (rows, vocab): tokens of the prompt or generated so far (repetition penalty, vLLM's definition);
- bias (rows, vocab): the request's logit_bias, dense.

The order, per row: logits + logit_bias, then the repetition penalty (a seen token's logit divided by it when
positive, multiplied when negative), then OpenAI's `logit -= count * frequency_penalty + (count > 0) *
presence_penalty`. Log-probabilities are the log-softmax of those processed logits: before temperature and
top-k/top-p, so they describe the model's distribution with the request's bias and penalties (what OpenAI's
`logprobs` report), and at temperature 0 the chosen token is the most probable one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .protocol import SamplingParams


@dataclass
class LogprobResult:
    logprob: float
    top: list[tuple[int, float]]          # (token id, logprob), most probable first


class LogitProcessor:
    def __init__(self, rows: int, vocab: int, device: torch.device):
        self.rows, self.vocab, self.device = rows, vocab, device
        self.counts: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def _buffers(self) -> None:
        if self.counts is None:
            self.counts = torch.zeros(self.rows, self.vocab, device=self.device)
            self.seen = torch.zeros(self.rows, self.vocab, dtype=torch.bool, device=self.device)
            self.bias = torch.zeros(self.rows, self.vocab, device=self.device)

    def start(self, row: int, params: SamplingParams, prompt: list[int]) -> None:
        """A sample that needs processing takes `row`: reset its counts, mark the prompt's tokens, load its bias."""
        self._buffers()
        self.counts[row].zero_()
        self.seen[row].zero_()
        self.seen[row, torch.tensor(prompt, device=self.device)] = True
        self.bias[row].zero_()
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), device=self.device)
            self.bias[row, ids] = torch.tensor(list(params.logit_bias.values()), device=self.device)

    def observe(self, rows: list[int], tokens: list[int]) -> None:
        """The tokens just appended to these rows (sampled or forced)."""
        if not rows:
            return
        r = torch.tensor(rows, device=self.device)
        t = torch.tensor(tokens, device=self.device)
        self.counts.index_put_((r, t), torch.ones(len(rows), device=self.device), accumulate=True)
        self.seen[r, t] = True

    def apply(self, logits: torch.Tensor, batch_idx: list[int], rows: list[int],
              params: list[SamplingParams]) -> torch.Tensor:
        """logits (B, V) float -> a copy with the rows `batch_idx` (cache rows `rows`, parameters `params`)
        processed."""
        out = logits.clone()
        b = torch.tensor(batch_idx, device=logits.device)
        r = torch.tensor(rows, device=self.device)
        x = out[b] + self.bias[r]
        rep = torch.tensor([p.repetition_penalty for p in params], device=logits.device)[:, None]
        x = torch.where(self.seen[r] & (rep != 1.0), torch.where(x > 0, x / rep, x * rep), x)
        counts = self.counts[r]
        freq = torch.tensor([p.frequency_penalty for p in params], device=logits.device)[:, None]
        pres = torch.tensor([p.presence_penalty for p in params], device=logits.device)[:, None]
        out[b] = x - counts * freq - (counts > 0).to(x.dtype) * pres
        return out


def logprobs(logits: torch.Tensor, batch_idx: list[int], chosen: list[int], top: list[int]) -> list[LogprobResult]:
    """The chosen tokens' log-probabilities and each row's `top[i]` most probable tokens, for the rows `batch_idx`
    of (processed) logits: one log-softmax and one top-k over those rows, one transfer."""
    b = torch.tensor(batch_idx, device=logits.device)
    lp = torch.log_softmax(logits[b].float(), dim=-1)
    picked = lp.gather(1, torch.tensor(chosen, device=logits.device)[:, None])[:, 0]
    k = max(top)
    if k:
        vals, ids = lp.topk(k, dim=-1)
        vals, ids = vals.tolist(), ids.tolist()
    picked = picked.tolist()
    return [LogprobResult(picked[j], list(zip(ids[j][:top[j]], vals[j][:top[j]])) if k else [])
            for j in range(len(batch_idx))]
