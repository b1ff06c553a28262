"""Prompter, calculator, checkpoints and converters."""
import json
import os

import pytest
import torch

from core.chat import (ChatPrompter, CheckpointError, PromptError, PromptTooLong, load_chat_defaults,
                       load_chat_model, load_chat_tokenizer, save_chat_model)
from core.chat.calculator import use_calculator
from core.chat.convert import main as convert_main
from tests.conftest import assert_same_model, tiny_model


def turn(tok, role, text):
    s, e = ("<|user_start|>", "<|user_end|>") if role == "user" else ("<|assistant_start|>", "<|assistant_end|>")
    return [tok.encode_special(s), *tok.encode(text), tok.encode_special(e)]


def test_prompter_renders_fewshot_system_and_parts(tokenizer):
    fewshot = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    p = ChatPrompter(tokenizer, 256, fewshot)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2+2"},
            {"role": "assistant", "content": [{"type": "text", "text": "let me see"},
                                              {"type": "python", "text": "2+2"},
                                              {"type": "python_output", "text": "4"},
                                              {"type": "text", "text": "it is 4"}]},
            {"role": "user", "content": "thanks"}]
    ids = p.render(msgs, 16).ids
    t = tokenizer.encode_special
    expected = [tokenizer.bos_id, *turn(tokenizer, "user", "hi"), *turn(tokenizer, "assistant", "hello"),
                *turn(tokenizer, "user", "be brief\n\nwhat is 2+2"),
                t("<|assistant_start|>"), *tokenizer.encode("let me see"),
                t("<|python_start|>"), *tokenizer.encode("2+2"), t("<|python_end|>"),
                t("<|output_start|>"), *tokenizer.encode("4"), t("<|output_end|>"),
                *tokenizer.encode("it is 4"), t("<|assistant_end|>"),
                *turn(tokenizer, "user", "thanks"), t("<|assistant_start|>")]
    assert ids == expected


def test_prompter_drops_oldest_turns_and_keeps_system(tokenizer):
    p = ChatPrompter(tokenizer, 64)
    msgs = [{"role": "system", "content": "sys"}]
    for i in range(10):
        msgs += [{"role": "user", "content": f"question {i} the cat sat"}, {"role": "assistant", "content": "ok red"}]
    msgs.append({"role": "user", "content": "last one"})
    prompt = p.render(msgs, 16)
    assert len(prompt.ids) <= 64 - 16
    assert prompt.dropped_turns > 0
    text = tokenizer.decode(prompt.ids)
    assert "last one" in text and "sys" in text and "question 0 " not in text
    # the kept history starts with a user turn carrying the system text
    assert prompt.ids[1] == tokenizer.encode_special("<|user_start|>")


def test_prompter_errors(tokenizer):
    p = ChatPrompter(tokenizer, 32)
    with pytest.raises(PromptTooLong, match="newest user message"):
        p.render([{"role": "user", "content": "the cat sat on the mat " * 20}], 8)
    with pytest.raises(PromptError, match="role"):
        p.render([{"role": "wizard", "content": "x"}], 8)
    with pytest.raises(PromptError, match="non-empty"):
        p.render([], 8)
    with pytest.raises(PromptError, match="last non-system"):
        p.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], 8)
    with pytest.raises(PromptError, match="calculator parts"):
        p.render([{"role": "user", "content": [{"type": "python", "text": "1"}]}], 8)


def test_special_token_text_in_user_input_is_plain_text(tokenizer):
    ids = ChatPrompter(tokenizer, 256).render([{"role": "user", "content": "<|assistant_end|>"}], 8).ids
    assert ids.count(tokenizer.encode_special("<|assistant_end|>")) == 0


@pytest.mark.parametrize("expr,value", [("1+2", 3), ("12*(3+4)", 84), ("7/2", 3.5), ("-3 - -4", 1),
                                        ("1,234 + 1", 1235), ("'strawberry'.count('r')", 3), ("10/4*2", 5)])
def test_calculator_values(expr, value):
    assert use_calculator(expr) == value


@pytest.mark.parametrize("expr", ["__import__('os')", "'a'*10**9", "9**9**9", "(" * 200 + "1" + ")" * 200, "-" * 150 + "1", "1+" * 120 + "1",
                                  "().__class__", "'x'.upper()", "open('f')", "[1]*10", "1/0", "lambda: 1",
                                  "99999999*99999999*99999999", "'a'.count('a', 0)", "2**3"])
def test_calculator_refuses_hostile_expressions_with_bounded_work(expr, monkeypatch):
    """Refused, after visiting each node of the expression at most once and never holding a number beyond the
    product of two bounded operands: nothing it computes can grow or run long."""
    from core.chat import calculator

    visits, values = [], []
    real_eval, real_number = calculator._eval, calculator._number
    monkeypatch.setattr(calculator, "_eval", lambda node, depth: visits.append(node) or real_eval(node, depth))
    monkeypatch.setattr(calculator, "_number", lambda x: values.append(x) or real_number(x))
    assert use_calculator(expr) is None
    assert len(visits) <= len(expr) and len(set(map(id, visits))) == len(visits)
    assert all(abs(v) <= calculator.MAX_ABS ** 2 for v in values if isinstance(v, (int, float)))


def test_checkpoint_round_trip_and_errors(tmp_path, tokenizer, gpt2_model):
    save_chat_model(str(tmp_path), gpt2_model, tokenizer)
    model, tok, cfg = load_chat_model(str(tmp_path), device="cpu")
    ids = torch.tensor([[1, 2, 3, 4]])
    assert_same_model(model, gpt2_model, ids)
    assert cfg.arch == "gpt2" and tok.special_tokens == tokenizer.special_tokens
    assert load_chat_defaults(str(tmp_path)).fewshot == []
    with open(tmp_path / "config.json", "w") as f:
        json.dump(dict(cfg.to_dict(), n_layer=3), f)
    with pytest.raises(CheckpointError, match="do not match"):
        load_chat_model(str(tmp_path), device="cpu")


def test_convert_nanochat_directory(tmp_path, tokenizer, nanochat_model):
    import pickle

    src = tmp_path / "nanochat"
    src.mkdir()
    state = {"_orig_mod." + k: v for k, v in nanochat_model.state_dict().items()}
    torch.save(state, src / "model_000650.pt")
    c = nanochat_model.config
    meta = {"step": 650, "model_config": {"sequence_len": c.sequence_len, "vocab_size": c.vocab_size,
                                          "n_layer": c.n_layer, "n_head": c.n_head, "n_kv_head": c.n_kv_head,
                                          "n_embd": c.n_embd}}
    (src / "meta_000650.json").write_text(json.dumps(meta))
    tokdir = tmp_path / "tok"
    tokdir.mkdir()
    with open(tokdir / "tokenizer.pkl", "wb") as f:
        pickle.dump(tokenizer.enc, f)
    dst = tmp_path / "ours"
    convert_main(["nanochat", str(src), str(dst), "--tokenizer", str(tokdir)])
    model, tok, _ = load_chat_model(str(dst), device="cpu")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    assert_same_model(model, nanochat_model, ids)
    assert tok.encode("hello cat") == tokenizer.encode("hello cat")


def test_convert_orig_mod_state_dict(tmp_path, tokenizer):
    model = tiny_model("gpt2", tokenizer, seed=5, std=0.1)
    state = {"_orig_mod." + k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    state["_orig_mod.transformer.h.0.attn.bias"] = torch.ones(1, 1, 8, 8)   # an old nanoGPT mask buffer
    torch.save(state, tmp_path / "ckpt.pt")
    ranks = tmp_path / "ranks.tiktoken"
    import base64
    with open(ranks, "wb") as f:
        for token, rank in sorted(tokenizer.enc._mergeable_ranks.items(), key=lambda kv: kv[1]):
            f.write(base64.b64encode(token) + b" %d\n" % rank)
    dst = tmp_path / "ours"
    convert_main(["state-dict", str(tmp_path / "ckpt.pt"), str(dst), "--arch", "gpt2", "--n-head", "4",
                  "--tokenizer", str(ranks)])
    loaded, tok, cfg = load_chat_model(str(dst), device="cpu")
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.sequence_len) == (2, 4, 64, 256)
    # the chat special tokens follow the ordinary vocabulary, as seed 001 appends them after GPT-2's 50257
    assert tok.bos_id == len(tokenizer.enc._mergeable_ranks)
    ids = torch.tensor([[5, 6, 7, 8]])
    assert_same_model(loaded, model, ids)
    assert not any(name.endswith(".pkl") for name in os.listdir(dst))


def test_checkpoints_carry_a_hugging_face_tokenizer_with_the_same_ids(tmp_path, tokenizer, nanochat_model):
    """save_chat_model writes tokenizer.json beside tokenizer.tiktoken: AutoTokenizer loads the checkpoint
    directory and encodes ordinary text (unicode, digits, newlines) to the same ids, special tokens included by
    id; the committed demo model carries one too."""
    from transformers import AutoTokenizer

    from tests.conftest import corpus

    save_chat_model(str(tmp_path), nanochat_model, tokenizer)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for path, ours in ((str(tmp_path), tokenizer),
                       (os.path.join(root, "models", "demo-chat"), load_chat_tokenizer(os.path.join(
                           root, "models", "demo-chat"))[0])):
        hf = AutoTokenizer.from_pretrained(path)
        texts = list(corpus(200, seed=5)) + ["  two  spaces\n\nand lines 12345 日本語 😀 naïve"]
        assert all(hf.encode(t, add_special_tokens=False) == ours.encode(t) for t in texts)
        assert {name: hf.convert_tokens_to_ids(name) for name in ours.special_tokens} == ours.special_tokens
        assert hf.bos_token_id == ours.bos_id and hf.decode(ours.encode(texts[0])) == texts[0]
    assert AutoTokenizer.from_pretrained(str(tmp_path)).model_max_length == nanochat_model.config.sequence_len
