"""Tiny hybrid (Gated DeltaNet + full attention) StartLux-Decision checkpoints with random weights."""
from __future__ import annotations

import random

WORDS = "the cat dog red blue green is are what which how many apple pear plum city river one two three".split()


def decision_corpus(n: int = 800, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        lines.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) + f" {rng.randint(0, 999)}")
    lines += ["State:\nQuestion: x\nOptions:\nYes\nNo\n[...]"] * 20
    return lines


def build_checkpoint(path: str, multimodal: bool = False, seed: int = 0, temperature_by_type=None, wide_choice=None,
                     template=None) -> str:
    from core.decision.build import (hybrid_text_config, new_hybrid_model, save_decision_checkpoint,
                                          train_decision_tokenizer)

    tok = train_decision_tokenizer(decision_corpus(), 800)
    cfg = hybrid_text_config(len(tok), pad_token_id=tok.pad_token_id)
    model = new_hybrid_model(cfg, multimodal=multimodal, seed=seed)
    save_decision_checkpoint(path, model, tok, temperature_by_type, wide_choice, template)
    return path
