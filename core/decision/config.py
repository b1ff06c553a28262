"""The decision scorer's settings: one record, passed whole from the deployment's settings to the scorer."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DecisionConfig:
    """Each default here is the one default of that setting (the decision deployment's settings embed it)."""

    max_length: int = 65536          # longest prompt (state + question block); a longer state is cut
    max_batch_tokens: int = 65536    # tokens computed per forward pass (a CPU is fastest at a few thousand)
    graphs: bool = True              # on CUDA, replay recorded graphs for a request that fits one
    prefix_cache_mb: float = 256     # prefix states kept across requests (0: none)
    share_prefix: bool = True        # the state block once per request and its questions continue from it;
                                     # off: every prompt whole (the seed's way, kept as a reference)

    def __post_init__(self) -> None:
        if self.max_length < 1 or self.max_batch_tokens < 1 or self.prefix_cache_mb < 0:
            raise ValueError("max_length and max_batch_tokens must be positive, prefix_cache_mb not negative")

    @property
    def prefix_cache_bytes(self) -> int:
        return int(self.prefix_cache_mb * (1 << 20))
