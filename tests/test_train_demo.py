"""tools/train_demo.py's phases: a resumed run trains only the phases it is asked for, with the data a whole run
draws there; the JSON-keys share draws what it names and leaves the earlier phases' data as it was."""
import random
from pathlib import Path

import torch

from core.chat import load_chat_model
from tools import demo_data as D
from tools import train_demo as T

DEMO = str(Path(__file__).resolve().parent.parent / "models" / "demo-chat")
DEMO_GPT2 = str(Path(DEMO).parent / "demo-gpt2")


def test_a_keys_share_of_zero_draws_the_data_the_earlier_phases_drew(monkeypatch):
    """keys_share 0 takes no draw of its own (the committed weights' phases see the same conversations), and
    keys_share 0.4 makes about 0.4 of the conversations JSON replies naming their keys."""
    a, b = random.Random(11), random.Random(11)
    assert [T.chat_example(a, 0.5) for _ in range(200)] == [T.chat_example(b, 0.5, 0.0) for _ in range(200)]
    named = []
    real = D.any_json_conversation
    monkeypatch.setattr(D, "any_json_conversation", lambda rng: named.append(1) or real(rng))
    monkeypatch.setattr(D, "json_conversation", lambda rng: [])     # its own share of named keys not counted
    rng = random.Random(3)
    for _ in range(2000):
        T.chat_example(rng, 0.5, 0.4)
    assert 0.37 < len(named) / 2000 < 0.43, len(named)


def test_a_run_resumed_at_a_later_phase_trains_only_that_phase(tmp_path, monkeypatch):
    for name in ("PIECES", "RESERVED"):
        monkeypatch.setattr(D, name, getattr(D, name).copy())
    D.PIECES.clear()
    ran = []
    real = T.chat_phase
    monkeypatch.setattr(T, "chat_phase", lambda *a, **k: ran.append(a[4:]) or real(*a, **k))
    # (the phases before it: one outer step each, so that a run of them shows in `ran` rather than taking hours)
    phases = [T.ChatPhase(T.POOL, 1e-3, 0.0), T.ChatPhase(T.POOL, 2e-3, 0.5), T.ChatPhase(T.POOL, 5e-4, 0.5, 0.4)]
    T.train_chat(str(tmp_path / "out"), phases, resume=DEMO, resume_phase=2)
    assert ran == [(5e-4, 0.5, 0.4)]            # phase 2 alone: learning rate, tools share, keys share
    assert len(D.PIECES) > 500                  # its made-up words use the tokenizer's pieces, as in a whole run
    before, tok, _ = load_chat_model(DEMO, device="cpu")
    after, tok2, _ = load_chat_model(str(tmp_path / "out"), device="cpu")
    assert tok2.encode("What is the capital of Peru?") == tok.encode("What is the capital of Peru?")
    moved = [n for (n, p), q in zip(before.named_parameters(), after.parameters(), strict=True)
             if not torch.equal(p, q)]
    assert moved, "the phase trained nothing"


def test_the_words_split_spells_a_word_in_prose_as_in_a_json_key():
    """SPLITS["words"]: the keys a request names tokenize in its prose as in the JSON reply's keys (what makes the
    copy a copy of the same tokens), in a tokenizer trained with it and in the committed demo-chat's; with GPT-4's
    split (demo-gpt2's) most do not, which is what the words split is for."""
    from core.chat.checkpoint import load_chat_tokenizer
    from core.chat.tokenizer import train_tokenizer
    from tools import demo_heldout as H

    texts = list(D.chat_corpus_text(seed=0))
    keys = sorted({k for ks in H.KEY_SETS for k in ks})

    def same(tok, k):
        prose, key = tok.encode(f"Reply with the keys {k} and more."), tok.encode(f'{{"{k}": 1}}')
        inner = tok.encode(k)
        return any(prose[i:i + len(inner)] == inner for i in range(len(prose))) and \
            any(key[i:i + len(inner)] == inner for i in range(len(key)))

    words = train_tokenizer(texts, 2048, T.SPLITS["words"])
    gpt4 = train_tokenizer(texts, 2048, T.SPLITS["gpt4"])
    assert all(same(words, k) for k in keys), [k for k in keys if not same(words, k)]
    assert sum(same(gpt4, k) for k in keys) < len(keys) / 2
    committed = load_chat_tokenizer(DEMO)[0]
    assert all(same(committed, k) for k in keys), [k for k in keys if not same(committed, k)]
    assert sum(same(load_chat_tokenizer(DEMO_GPT2)[0], k) for k in keys) < len(keys) / 2
