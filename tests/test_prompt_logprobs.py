"""Prompt scoring in the engine (prompt_logprobs): against one uncached forward pass over the whole prompt.

What lm-evaluation-harness's multiple-choice tasks need: every prompt token's log-probability (the first has
none), the most probable tokens at each place, a prompt scored without generating (max_tokens 0), and the
choices of one question, which share their context, served from the prefix cache without changing a number.
"""
import random

import pytest
import torch

from core.chat import LLMEngine, SamplingParams


def reference(model, prompt, k):
    """[(token, logprob, top k)] per prompt position, from one uncached forward."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt]))[0].float(), -1)
    out = [(prompt[0], None, None)]
    for p in range(1, len(prompt)):
        vals, idx = lp[p - 1].topk(k) if k else (torch.tensor([]), torch.tensor([], dtype=torch.long))
        out.append((prompt[p], lp[p - 1, prompt[p]].item(), list(zip(idx.tolist(), vals.tolist()))))
    return out


def scored(engine, requests):
    """Run requests [(rid, prompt, params)] together; -> {rid: (prompt logprobs, events of sample 0)}."""
    for rid, prompt, params in requests:
        engine.add_request(prompt, params, rid)
    out = {rid: (None, []) for rid, _, _ in requests}
    while engine.has_work():
        for ev in engine.step():
            if ev.index == 0:
                entries, events = out[ev.request_id]
                out[ev.request_id] = (ev.prompt_logprobs if ev.prompt_logprobs is not None else entries,
                                      events + [ev])
    return out


def close(got, want):
    assert len(got) == len(want)
    for (t, lp, top), (rt, rlp, rtop) in zip(got, want):
        assert t == rt
        if rlp is None:
            assert lp is None and top is None
            continue
        assert lp == pytest.approx(rlp, abs=1e-4)
        assert [i for i, _ in top] == [i for i, _ in rtop] or all(
            abs(v - rv) < 1e-4 for (_, v), (_, rv) in zip(top, rtop))   # ties may swap places
        assert [v for _, v in top] == pytest.approx([v for _, v in rtop], abs=1e-4)


@pytest.mark.parametrize("chunk", [512, 7])
def test_prompt_logprobs_match_an_uncached_forward(nanochat_model, tokenizer, chunk):
    """Whole prompts and prompts prefilled 7 tokens a step; beside a request that asks for nothing."""
    rng = random.Random(chunk)
    prompt = [rng.randrange(500) for _ in range(40)]
    engine = LLMEngine(nanochat_model, tokenizer, max_rows=3, prefill_chunk=chunk)
    got = scored(engine, [("a", prompt, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=3)),
                          ("b", prompt[:20], SamplingParams(max_tokens=3, temperature=0))])
    close(got["a"][0], reference(nanochat_model, prompt, 3))
    assert got["b"][0] is None
    first = got["a"][1][0]
    assert first.prompt_logprobs is not None and first.token is not None     # on the first token's event
    assert all(ev.prompt_logprobs is None for ev in got["a"][1][1:])


def test_max_tokens_zero_scores_the_prompt_only(nanochat_model, tokenizer):
    prompt = list(range(5, 30))
    engine = LLMEngine(nanochat_model, tokenizer, max_rows=2)
    entries, events = scored(engine, [("s", prompt, SamplingParams(max_tokens=0, prompt_logprobs=0))])["s"]
    assert [ev.token for ev in events] == [None] and events[0].finish_reason == "length"
    assert events[0].completion_tokens == 0
    close(entries, reference(nanochat_model, prompt, 0))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)                                      # only a scored prompt may generate none


def test_the_choices_of_one_question_hit_the_prefix_cache_and_score_the_same(nanochat_model, tokenizer):
    """Four continuations of one 48-token context, one after another (as lm-eval sends them): from the second on,
    the context comes from the cache (cached_tokens: all but its last position, whose logits score the first new
    token: computed again in a copy of its block), and every entry equals the uncached forward's."""
    rng = random.Random(2)
    context = [rng.randrange(500) for _ in range(48)]
    engine = LLMEngine(nanochat_model, tokenizer, max_rows=2, block_size=8)
    for i in range(4):
        prompt = context + [rng.randrange(500) for _ in range(3 + i)]
        entries, events = scored(engine, [(f"c{i}", prompt, SamplingParams(max_tokens=1, temperature=0,
                                                                              prompt_logprobs=1))])[f"c{i}"]
        close(entries, reference(nanochat_model, prompt, 1))
        assert events[0].cached_tokens == (0 if i == 0 else len(context) - 1)
    # a request that asks for more alternatives than the cache kept computes the context again
    prompt = context + [1, 2]
    entries, events = scored(engine, [("more", prompt, SamplingParams(max_tokens=1, prompt_logprobs=4))])["more"]
    close(entries, reference(nanochat_model, prompt, 4))
    assert events[0].cached_tokens == 0
    # and a request that asks for none reuses the whole context as usual
    _, events = scored(engine, [("plain", context + [9], SamplingParams(max_tokens=1))])["plain"]
    assert events[0].cached_tokens == len(context)
