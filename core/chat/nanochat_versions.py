"""Which nanochat version wrote a checkpoint, and the ChatModelConfig that computes what its `GPT` computed.

nanochat's `GPT` changed after its release (karpathy/nanochat, `git log -- nanochat/gpt.py`); a checkpoint
(`model_<step>.pt` + `meta_<step>.json`) records its sizes and, since 2026-01-11, its `window_pattern`, but not
its version. Most of the version shows in the state dict's keys and shapes; what does not (the rotary base, the
q/k scale, the softcap, the short window's length) follows from the version those keys identify, and the
converter's options override it. docs/checkpoints.md has the same table for users.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import CheckpointError

FP32_EPS = torch.finfo(torch.float32).eps   # nanochat's F.rms_norm has no eps: the dtype's, fp32's on a CPU


@dataclass(frozen=True)
class Version:
    name: str
    since: str                      # the date of the commit that introduced it
    residual_lambdas: bool = False
    value_embeds: bool = False
    ve_gate_channels: int = 12
    ve_gate_range: float = 3.0
    smear: bool = False             # and backout: they arrived together
    rope_theta: float = 10000.0
    qk_scale: float = 1.0
    short_divisor: int = 2          # a short window is sequence_len / this
    short_rounded: bool = False     # ... rounded up to a multiple of 128 (FA3's tile)

    def short_window(self, sequence_len: int) -> int:
        """As nanochat's gpt.py computes it: sequence_len // 2, or (since 2026-03-09) sequence_len / 3 or / 4
        rounded up to a multiple of 128 (its `-(-long_window // 4 // 128) * 128`)."""
        if self.short_rounded:
            return -(-sequence_len // self.short_divisor // 128) * 128
        return sequence_len // self.short_divisor


VERSIONS = (
    Version("release", "2025-10-13"),
    Version("lambdas-and-windows", "2026-01-11", residual_lambdas=True),
    Version("value-embeddings", "2026-01-16", residual_lambdas=True, value_embeds=True, ve_gate_channels=32,
            ve_gate_range=2.0),
    Version("autoresearch", "2026-03-09", residual_lambdas=True, value_embeds=True, rope_theta=100000.0,
            qk_scale=1.15, short_divisor=3, short_rounded=True),
    Version("smear-and-backout", "2026-03-14", residual_lambdas=True, value_embeds=True, rope_theta=100000.0,
            qk_scale=1.2, short_divisor=4, short_rounded=True, smear=True),
)
PAD_TO = 64         # since 2025-12-09 nanochat pads its embedding and head to a multiple of this many rows


def recognise(state: dict[str, torch.Tensor], n_layer: int) -> Version:
    """The nanochat version whose parameters `state` has (names as nanochat's `GPT.state_dict()` writes them)."""
    has = set(state)
    if "smear_gate.weight" in has:
        return VERSIONS[4]
    if any(k.startswith("value_embeds.") for k in has):
        gate = state.get(f"transformer.h.{n_layer - 1}.attn.ve_gate.weight")
        if gate is None:
            raise CheckpointError("the checkpoint has value_embeds but no attn.ve_gate on its last layer: a nanochat "
                                  "version of 2026-01-16 between the releases this converter knows (value "
                                  "embeddings on every layer, v0_lambdas); convert it with nanochat from "
                                  "2026-01-16 on")
        return VERSIONS[3] if gate.shape[1] == 12 else VERSIONS[2]
    if "resid_lambdas" in has:
        return VERSIONS[1]
    return VERSIONS[0]


def padded_rows(vocab_size: int) -> int:
    return -(-vocab_size // PAD_TO) * PAD_TO


def crop_padding(state: dict[str, torch.Tensor], vocab_size: int) -> tuple[dict[str, torch.Tensor], int]:
    """Drop the rows nanochat pads its embedding, value embeddings and head with (never a real token: its
    logits are cropped to the vocabulary) -> (state, rows dropped)."""
    rows = state["transformer.wte.weight"].shape[0]
    if rows == vocab_size:
        return state, 0
    if rows != padded_rows(vocab_size):
        raise CheckpointError(f"transformer.wte has {rows} rows; meta's model_config.vocab_size {vocab_size} gives "
                              f"{vocab_size} or, padded to a multiple of {PAD_TO}, {padded_rows(vocab_size)}")
    out = {k: v[:vocab_size] if k in ("transformer.wte.weight", "lm_head.weight") or k.startswith("value_embeds.")
           else v for k, v in state.items()}
    return out, rows - vocab_size


def config_fields(version: Version, model_config: dict, rope_theta: float | None = None,
                  qk_scale: float | None = None, logit_softcap: float | None = None,
                  short_window: int | None = None) -> dict:
    """ChatModelConfig keys for a checkpoint of `version` with nanochat's `model_config` (meta_<step>.json);
    the keyword arguments override what the version implies."""
    seq = model_config["sequence_len"]
    pattern = model_config.get("window_pattern", "L") if version.residual_lambdas else "L"
    return dict(
        arch="nanochat", vocab_size=model_config["vocab_size"], n_layer=model_config["n_layer"],
        n_head=model_config["n_head"], n_kv_head=model_config.get("n_kv_head", model_config["n_head"]),
        n_embd=model_config["n_embd"], sequence_len=seq, rms_norm_eps=FP32_EPS,
        rope_theta=version.rope_theta if rope_theta is None else rope_theta,
        qk_scale=version.qk_scale if qk_scale is None else qk_scale,
        logit_softcap=15.0 if logit_softcap is None else logit_softcap,
        window_pattern=pattern,
        short_window=(version.short_window(seq) if short_window is None else short_window) if "S" in pattern.upper()
        else 0,
        residual_lambdas=version.residual_lambdas, value_embeds=version.value_embeds,
        ve_gate_channels=version.ve_gate_channels, ve_gate_range=version.ve_gate_range,
        smear=version.smear, backout=version.smear,
    )
