"""Checkpoints of every nanochat version convert and compute what nanochat's own code computes.

tests/data/nanochat/<era>/ holds what nanochat itself wrote and computed (tools/nanochat_reference.py, run on its
source at three commits): a tiny random checkpoint saved by its `save_checkpoint`, its tokenizer.pkl, the fp32
logits of its `GPT.forward` for a 64- and a 300-token prompt, and the greedy tokens of its `Engine.generate`.
The release-era references ran with fp32 rotary tables (nanochat kept them in bf16 until 2026-03, even on a
CPU; the script lifts that so the comparison is of the architecture's math).
"""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from core.chat import LLMEngine, SamplingParams
from core.chat.config import CheckpointError
from core.chat.convert import convert_nanochat, main
from core.chat.nanochat_versions import FP32_EPS
from core.chat.weights import load_chat_model

DATA = os.path.join(os.path.dirname(__file__), "data", "nanochat")
ERAS = ("release", "padded", "current")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = {}
    for era in ERAS:
        dst = str(tmp_path_factory.mktemp(era))
        version = convert_nanochat(os.path.join(DATA, era), dst)
        out[era] = (version, *load_chat_model(dst, device="cpu"))
    return out


def reference(era):
    with open(os.path.join(DATA, era, "reference.json"), encoding="utf-8") as f:
        return json.load(f), load_file(os.path.join(DATA, era, "reference.safetensors"))


def test_each_era_is_recognised_and_its_features_recorded(converted):
    features = lambda c: (c.residual_lambdas, c.value_embeds, c.smear, c.backout)  # noqa: E731
    for era in ("release", "padded"):
        version, model, tok, cfg = converted[era]
        assert version.name == "release" and features(cfg) == (False,) * 4
        assert (cfg.rope_theta, cfg.qk_scale, cfg.window_pattern) == (10000.0, 1.0, "L")
    version, model, tok, cfg = converted["current"]
    assert version.name == "smear-and-backout" and features(cfg) == (True,) * 4
    assert (cfg.rope_theta, cfg.qk_scale, cfg.window_pattern, cfg.short_window) == (100000.0, 1.2, "SSSL", 128)
    assert cfg.layer_windows == [128, 128, 128, None] and cfg.value_embed_layers == [1, 3]
    for version, model, tok, cfg in converted.values():
        # the padded eras' 320 embedding rows are cut to the vocabulary: no padded id can be sampled or reported
        assert cfg.vocab_size == tok.vocab_size == 300 == model.lm_head.weight.shape[0]
        assert cfg.rms_norm_eps == FP32_EPS
    raw = torch.load(os.path.join(DATA, "padded", "model_000000.pt"), weights_only=True)
    assert raw["transformer.wte.weight"].shape[0] == 320 and raw["transformer.wte.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("era", ERAS)
def test_logits_equal_nanochats_at_64_and_300_positions(converted, era):
    """Within 1e-4 in fp32; the 300-token prompt runs past the current era's 128-position short window."""
    _, model, _, _ = converted[era]
    ref, logits = reference(era)
    with torch.no_grad():
        short = model(torch.tensor([ref["short"]]))[0]
        long = model(torch.tensor([ref["long"]]))[0][logits["long_positions"]]
    assert (short - logits["short"]).abs().max().item() <= 1e-4
    assert (long - logits["long"]).abs().max().item() <= 1e-4
    assert logits["long"].std() > 1.0          # a reference with spread, not a flat one


@pytest.mark.parametrize("chunk", [512, 16], ids=["one-pass", "chunked"])
@pytest.mark.parametrize("era", ERAS)
def test_greedy_tokens_equal_nanochats_engine(converted, era, chunk):
    """Our engine, all prompts batched (prefill in one pass or in chunks of 16, then decode), against nanochat's
    Engine.generate one prompt at a time. nanochat yields the end-of-turn token it stops on; ours ends the stream
    there with finish_reason stop."""
    _, model, tok, _ = converted[era]
    ref, _ = reference(era)
    engine = LLMEngine(model, tok, max_rows=4, prefill_chunk=chunk)
    for i, g in enumerate(ref["generations"]):
        engine.add_request(g["prompt"], SamplingParams(max_tokens=ref["max_tokens"], temperature=0.0), f"g{i}")
    out, finish = {}, {}
    while engine.has_work():
        for ev in engine.step():
            if ev.token is not None:
                out.setdefault(ev.request_id, []).append(ev.token)
            if ev.finish_reason:
                finish[ev.request_id] = ev.finish_reason
    ends = {tok.encode_special("<|assistant_end|>"), tok.bos_id}
    for i, g in enumerate(ref["generations"]):
        theirs = g["greedy"]
        if finish[f"g{i}"] == "stop":
            assert theirs[-1] in ends
            theirs = theirs[:-1]
        assert out.get(f"g{i}", []) == theirs, i
    assert sum(len(g["greedy"]) for g in ref["generations"]) > 60


def test_options_override_what_the_version_implies(tmp_path):
    convert_nanochat(os.path.join(DATA, "current"), str(tmp_path / "a"), rope_theta=5e4, qk_scale=1.15,
                     logit_softcap=20.0, short_window=256)
    cfg = load_chat_model(str(tmp_path / "a"), device="cpu")[2]
    assert (cfg.rope_theta, cfg.qk_scale, cfg.logit_softcap, cfg.short_window) == (5e4, 1.15, 20.0, 256)
    main(["nanochat", os.path.join(DATA, "release"), str(tmp_path / "b"), "--logit-softcap", "20"])
    assert load_chat_model(str(tmp_path / "b"), device="cpu")[2].logit_softcap == 20.0


def _variant(tmp_path, edit):
    src = tmp_path / "src"
    src.mkdir()
    state = torch.load(os.path.join(DATA, "current", "model_000000.pt"), weights_only=True)
    edit(state)
    torch.save(state, src / "model_000000.pt")
    for name in ("meta_000000.json", "tokenizer.pkl"):
        (src / name).write_bytes(open(os.path.join(DATA, "current", name), "rb").read())
    return str(src)


def test_a_checkpoint_of_no_known_version_is_refused_by_name(tmp_path):
    def every_layer_ve(state):       # a variant of 2026-01-16 that lived for hours: value embeddings and v0_lambdas
        state["v0_lambdas"] = torch.zeros(4)
    with pytest.raises(CheckpointError, match=r"unexpected \['v0_lambdas'\].*smear-and-backout.*docs/checkpoints"):
        convert_nanochat(_variant(tmp_path, every_layer_ve), str(tmp_path / "out"))


def test_a_missing_parameter_is_named(tmp_path):
    with pytest.raises(CheckpointError, match=r"missing \['backout_lambda'\]"):
        convert_nanochat(_variant(tmp_path, lambda s: s.pop("backout_lambda")), str(tmp_path / "out"))


def test_a_vocabulary_that_is_neither_its_size_nor_padded_is_refused(tmp_path):
    def wrong(state):
        state["transformer.wte.weight"] = state["transformer.wte.weight"][:310]
    with pytest.raises(CheckpointError, match="310 rows.*300 or, padded to a multiple of 64, 320"):
        convert_nanochat(_variant(tmp_path, wrong), str(tmp_path / "out"))


def test_short_windows_are_nanochats():
    """Each version's short window for a context, as its gpt.py writes it."""
    from core.chat.nanochat_versions import VERSIONS

    by_name = {v.name: v for v in VERSIONS}
    for seq in (512, 1000, 1027, 1028, 2048):
        assert by_name["lambdas-and-windows"].short_window(seq) == seq // 2
        assert by_name["autoresearch"].short_window(seq) == -(-seq // 3 // 128) * 128
        assert by_name["smear-and-backout"].short_window(seq) == -(-seq // 4 // 128) * 128
    assert by_name["smear-and-backout"].short_window(1027) == 384 and by_name["autoresearch"].short_window(2048) == 768
