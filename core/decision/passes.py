"""Planning the decision model's passes over question tails: which tails share a pass.

Each tail continues from its prefix's state (prefix_cache.py). Tails in one pass are right-padded to the
longest, and the prefixes' keys are left-padded to the longest prefix, so a pass over n rows costs about
n x longest tail x (the model's per-token work + attention over longest prefix + tail), plus a fixed cost per
pass (operator dispatch, kernel launches). Padding is work for nothing; every extra pass pays the fixed cost
again. `plan` splits the rows into passes that minimise the sum, within two bounds: the tokens a pass computes
(rows x longest tail, the activations) and the positions its cache holds (rows x (longest prefix + longest
tail), the keys and values; cheap next to activations, so `HELD_PER_COMPUTED` times as many). Splitting every row into its own pass is among the plans it
weighs, so a batch is never planned to cost more than running its rows one request at a time.
"""
from __future__ import annotations

from dataclasses import dataclass

# A pass costs about this many computed positions more than the positions themselves: on a CPU, operator
# dispatch of a small model; on a GPU, kernel launches, which bound small passes there.
PASS_OVERHEAD_TOKENS = {"cpu": 64, "cuda": 2048}
MAX_ROWS_PER_PASS = 256
HELD_PER_COMPUTED = 16


@dataclass(frozen=True)
class PassCost:
    token_flops: float       # per computed position: 2 x the parameters a position goes through
    key_flops: float         # per (computed position, key): 4 x attention layers x heads x head size
    overhead_tokens: int     # the fixed cost of a pass, in computed positions

    @classmethod
    def of(cls, body, device_type: str) -> "PassCost":
        cfg = body.config
        embed = body.get_input_embeddings().weight.numel()
        params = sum(p.numel() for p in body.parameters()) - embed
        attention_layers = sum(t == "full_attention" for t in getattr(cfg, "layer_types", ["full_attention"]))
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(2.0 * params, 4.0 * attention_layers * cfg.num_attention_heads * head_dim,
                   PASS_OVERHEAD_TOKENS.get(device_type, PASS_OVERHEAD_TOKENS["cuda"]))

    def of_pass(self, rows: int, prefix: int, tail: int) -> float:
        return (self.overhead_tokens * self.token_flops
                + rows * tail * (self.token_flops + self.key_flops * (prefix + tail)))


def plan(rows: list[tuple[int, int]], max_tokens: int, cost: PassCost) -> list[list[int]]:
    """rows: (prefix length, tail length) per tail -> passes, each a list of row indices. Rows are ordered by
    prefix then tail length (longest first) and cut into consecutive passes by dynamic programming; a pass of
    more than one row computes at most `max_tokens` tokens (rows x longest tail) and holds at most
    `HELD_PER_COMPUTED * max_tokens` positions (rows x (longest prefix + longest tail))."""
    order = sorted(range(len(rows)), key=lambda i: (-rows[i][0], -rows[i][1]))
    n = len(order)
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        longest_tail = 0
        for start in range(end - 1, max(-1, end - 1 - MAX_ROWS_PER_PASS), -1):
            longest_tail = max(longest_tail, rows[order[start]][1])
            longest_prefix = rows[order[start]][0]       # the order puts the longest prefix first
            size = end - start
            if size > 1 and (size * longest_tail > max_tokens
                             or size * (longest_prefix + longest_tail) > HELD_PER_COMPUTED * max_tokens):
                break
            c = best[start] + cost.of_pass(size, longest_prefix, longest_tail)
            if c < best[end]:
                best[end], cut[end] = c, start
    passes, end = [], n
    while end > 0:
        passes.append(order[cut[end]:end])
        end = cut[end]
    return passes[::-1]
