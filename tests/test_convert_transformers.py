"""`python -m core.chat.convert transformers DIR OUT`: transformers checkpoint directories in one command, exact to
transformers' own models, the tokenizer's ids equal to the tokenizer.json it came from."""
import os

import pytest
import torch

from core.chat.config import CheckpointError
from core.chat.convert import main
from core.chat.tokenizer import SPECIAL_TOKENS
from core.chat.weights import load_chat_model
from tests.conftest import corpus, tiny_model
from tests.test_chat_model import to_hf_nanochat


def hf_tokenizer_without_chat_tokens(tokenizer, path):
    """A GPT-2-like tokenizer.json: the ordinary vocabulary and `<|endoftext|>`, none of the chat tokens."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tokenizer.save(str(path))
    with open(os.path.join(path, "tokenizer.tiktoken"), "rb") as f:
        ordinary = [line for line in f if line.strip()]
    with open(os.path.join(path, "ordinary.tiktoken"), "wb") as f:
        f.writelines(ordinary)
    converted = TikTokenConverter(vocab_file=os.path.join(path, "ordinary.tiktoken"), pattern=tokenizer.pattern,
                                  extra_special_tokens=["<|endoftext|>"]).converted()
    fast = PreTrainedTokenizerFast(tokenizer_object=converted, eos_token="<|endoftext|>")
    fast.save_pretrained(str(path))
    for name in ("tokenizer.tiktoken", "ordinary.tiktoken"):
        os.remove(os.path.join(path, name))
    return fast, len(ordinary) + 1


def test_a_gpt2_directory_converts_exactly(tokenizer, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    src = tmp_path / "gpt2"
    fast, vocab = hf_tokenizer_without_chat_tokens(tokenizer, src)
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=128, n_embd=64, n_layer=2, n_head=4,
                                    initializer_range=0.2)).eval()
    hf.save_pretrained(str(src))
    main(["transformers", str(src), str(tmp_path / "out")])
    model, tok, cfg = load_chat_model(str(tmp_path / "out"), device="cpu")
    assert (cfg.arch, cfg.gelu_approximate, cfg.sequence_len) == ("gpt2", "tanh", 128)
    # the nine chat tokens appended after <|endoftext|>, the model grown to match
    assert tok.vocab_size == cfg.vocab_size == vocab + len(SPECIAL_TOKENS)
    assert [tok.encode_special(s) for s in SPECIAL_TOKENS] == list(range(vocab, vocab + len(SPECIAL_TOKENS)))
    for text in list(corpus(50, seed=3)):
        assert tok.encode(text) == fast.encode(text)
    ids = torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert (ours[..., :vocab] - theirs).abs().max().item() <= 1e-4
    assert theirs.std() > 0.5
    # a new row is the mean embedding: its logit is an ordinary token's, not a spike above every other
    assert ours[..., vocab:].max() < ours[..., :vocab].max(dim=-1).values.min()


def test_a_nanochat_transformers_directory_converts_exactly(tokenizer, tmp_path):
    model = tiny_model("nanochat", tokenizer, seed=5, std=0.3)
    hf = to_hf_nanochat(model)
    src = tmp_path / "nanochat-hf"
    hf.save_pretrained(str(src))
    from core.chat.hf_tokenizer import write_hf_tokenizer
    tokenizer.save(str(src))
    write_hf_tokenizer(str(src), tokenizer, 256)
    os.remove(src / "tokenizer.tiktoken")
    main(["transformers", str(src), str(tmp_path / "out")])
    ours, tok, cfg = load_chat_model(str(tmp_path / "out"), device="cpu")
    assert tok.special_tokens == tokenizer.special_tokens and tok.vocab_size == tokenizer.vocab_size
    for text in corpus(30, seed=4):
        assert tok.encode(text) == tokenizer.encode(text)
    ids = torch.randint(0, tokenizer.vocab_size, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max().item() <= 1e-4


def test_an_unknown_architecture_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(CheckpointError, match="LlamaForCausalLM.*GPT2LMHeadModel"):
        main(["transformers", str(tmp_path), str(tmp_path / "out")])
