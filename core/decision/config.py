"""The decision scorer's two configurations, each read into one record with its defaults written once:

- `DecisionConfig`: the deployment's settings for its scorer, passed whole from the service's settings to the
  scorer (or the synthetic scorer, `backend: synthetic`);
- `CheckpointConfig`: what a StartLux-Decision checkpoint declares in its `decision_config.json` (the answer
  letters' token ids, each question type's temperature, how wide choices run, the prompt template's changes).

Torch-free: the Ingress and the settings import it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import msgspec

BACKENDS = ("model", "synthetic")   # the checkpoint's model, or synthetic.py's scorer without one (benchmarks)
# One question of the demo model on an H200 (bf16, CUDA graphs, a loop of `decide`: 1,222 questions/s on
# 2026-11-30; batches of 4,096 tokens per pass made 1,153, bench/README.md "On an H200"): what the synthetic
# scorer charges per question, whatever its batch
H200_QUESTION_S = 1 / 1222
MAX_OPTIONS = 26


@dataclass(frozen=True, slots=True)
class DecisionConfig:
    """Each default here is the one default of that setting (the decision deployment's settings embed it)."""

    max_length: int = 65536          # longest prompt (state + question block); a longer state is cut
    max_batch_tokens: int = 65536    # tokens computed per forward pass (a CPU is fastest at a few thousand)
    graphs: bool = True              # on CUDA, replay recorded graphs for a request that fits one
    prefix_cache_mb: float = 256     # prefix states kept across requests (0: none)
    share_prefix: bool = True        # the state block once per request and its questions continue from it;
                                     # off: every prompt whole (the seed's way, kept as a reference)
    backend: str = "model"           # "synthetic": no model, each batch takes the time below (benchmarks)
    synthetic_question_s: float = H200_QUESTION_S   # the synthetic scorer's time per question of a batch
    synthetic_batch_s: float = 0.0   # ... and per batch

    def __post_init__(self) -> None:
        if self.max_length < 1 or self.max_batch_tokens < 1 or self.prefix_cache_mb < 0:
            raise ValueError("max_length and max_batch_tokens must be positive, prefix_cache_mb not negative")
        if self.backend not in BACKENDS:
            raise ValueError(f"the decision scorer is one of {list(BACKENDS)}, not {self.backend!r}")
        if not (0 <= self.synthetic_question_s <= 10 and 0 <= self.synthetic_batch_s <= 10):
            raise ValueError("synthetic_question_s and synthetic_batch_s must be in [0, 10] seconds")

    @property
    def prefix_cache_bytes(self) -> int:
        return int(self.prefix_cache_mb * (1 << 20))


class WideChoice(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Choices over more options than one prompt shows run as a tournament (scorer._wide)."""

    group: int = 25                  # options per first-round prompt (near-equal groups of at most this)
    keep: int = 3                    # finalists each group sends on
    residual: float = 1e-3           # the probability mass the options that did not go on share
    max_options: int = MAX_OPTIONS   # the most options one prompt shows


class CheckpointConfig(msgspec.Struct, frozen=True):
    """A checkpoint's `decision_config.json`. Unknown keys are ignored (a checkpoint may carry notes)."""

    letter_token_ids: list[int]                       # the tokens of " A".." Z" as they follow the prompt
    temperature_by_type: dict[str, float] = {}        # question type -> the temperature its logits are divided by
    wide_choice: WideChoice = WideChoice()
    template: dict = {}                               # changes to jevfmt.DEFAULT_TEMPLATE

    def __post_init__(self) -> None:
        w = self.wide_choice
        if not 2 <= w.group <= w.max_options <= MAX_OPTIONS or not 1 <= w.keep < w.group:
            raise ValueError("wide_choice needs 2 <= group <= max_options <= 26 and 1 <= keep < group")

    def temperature(self, question_type: str) -> float:
        return float(self.temperature_by_type.get(question_type, 1.0))

    @classmethod
    def read(cls, checkpoint: str) -> "CheckpointConfig":
        path = os.path.join(checkpoint, "decision_config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: missing")
        with open(path, "rb") as f:
            raw = f.read()
        try:
            return msgspec.json.decode(raw, type=cls)
        except (msgspec.ValidationError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from None
