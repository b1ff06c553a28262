"""Logit processing in the engine: logprobs, logit_bias and penalties, against a full forward pass of the model."""
import math

import pytest
import torch

from core.chat import LLMEngine, SamplingError, SamplingParams
from tests.test_chat_engine import collect, prompts, run_alone, scripted_engine


def run(model, tokenizer, prompt, params, rid="r"):
    """-> the request's sample-0 events with a token."""
    engine = LLMEngine(model, tokenizer, max_rows=params.n)
    engine.add_request(prompt, params, rid)
    out = []
    while engine.has_work():
        out += [ev for ev in engine.step() if ev.token is not None and ev.index == 0]
    return out


def reference(model, prompt, tokens, params):
    """Processed log-probabilities at each generated position, from one uncached forward over prompt + tokens,
    with the definitions written out: bias, then repetition penalty over prompt + output, then OpenAI's
    frequency and presence penalties over the output so far."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens]))[0].float()
    out = []
    for i in range(len(tokens)):
        x = logits[len(prompt) - 1 + i].clone()
        for tok, b in params.logit_bias.items():
            x[tok] += b
        seen = set(prompt) | set(tokens[:i])
        for tok in seen:
            x[tok] = x[tok] / params.repetition_penalty if x[tok] > 0 else x[tok] * params.repetition_penalty
        for tok in set(tokens[:i]):
            c = tokens[:i].count(tok)
            x[tok] -= c * params.frequency_penalty + params.presence_penalty
        out.append(torch.log_softmax(x, -1))
    return out


@pytest.mark.parametrize("extra", [
    {},
    {"frequency_penalty": 1.5},
    {"presence_penalty": -1.0, "frequency_penalty": 0.5},
    {"repetition_penalty": 1.3},
    {"logit_bias": {7: 3.0, 11: -2.0}, "frequency_penalty": 0.7, "repetition_penalty": 0.9},
])
def test_logprobs_and_processing_match_the_definitions(nanochat_model, tokenizer, extra):
    prompt = prompts(1, seed=3)[0]
    params = SamplingParams(max_tokens=20, temperature=0.0, logprobs=5, **extra)
    events = run(nanochat_model, tokenizer, prompt, params)
    tokens = [ev.token for ev in events]
    ref = reference(nanochat_model, prompt, tokens, params)
    for ev, lp in zip(events, ref):
        assert ev.logprob <= 0 and ev.logprob == pytest.approx(lp[ev.token].item(), abs=1e-4)
        assert ev.token == int(lp.argmax())                        # greedy picks the processed argmax
        top = ev.top_logprobs
        assert len(top) == 5 and top[0][0] == ev.token and top[0][1] == pytest.approx(ev.logprob, abs=1e-6)
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert sum(math.exp(v) for _, v in top) <= 1 + 1e-6
        ref_top = lp.topk(5)
        assert [t for t, _ in top] == ref_top.indices.tolist()


def test_frequency_penalty_lowers_a_repeated_token_by_count_times_penalty(nanochat_model, tokenizer):
    """The logit gap between a token and another changes by exactly count x penalty."""
    prompt = prompts(1, seed=4)[0]
    plain = run(nanochat_model, tokenizer, prompt, SamplingParams(max_tokens=12, temperature=0.0, logprobs=20))
    tokens = [ev.token for ev in plain]
    repeated = max(set(tokens), key=tokens.count)
    raw = reference(nanochat_model, prompt, tokens, SamplingParams())
    pen = reference(nanochat_model, prompt, tokens, SamplingParams(frequency_penalty=0.8))
    never = next(t for t in range(tokenizer.vocab_size) if t not in tokens)
    for i in range(len(tokens)):
        c = tokens[:i].count(repeated)
        gap_raw = raw[i][repeated] - raw[i][never]
        gap_pen = pen[i][repeated] - pen[i][never]
        assert (gap_raw - gap_pen).item() == pytest.approx(0.8 * c, abs=1e-4)


def test_positive_bias_of_100_makes_the_token_the_greedy_choice(nanochat_model, tokenizer):
    prompt = prompts(1, seed=5)[0]
    target = 123
    events = run(nanochat_model, tokenizer, prompt,
                 SamplingParams(max_tokens=6, temperature=0.0, logit_bias={target: 100.0}))
    assert [ev.token for ev in events] == [target] * 6
    events = run(nanochat_model, tokenizer, prompt,
                 SamplingParams(max_tokens=6, temperature=0.0, logit_bias={target: -100.0}, logprobs=0))
    assert all(ev.token != target and ev.top_logprobs == [] for ev in events)


def test_batch_mixing_processed_and_plain_rows_gives_each_its_own_tokens(nanochat_model, tokenizer):
    ps = prompts(4, seed=6)
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=10),
              SamplingParams(max_tokens=16, temperature=1.0, seed=11, logprobs=3),
              SamplingParams(max_tokens=16, temperature=1.0, seed=12, frequency_penalty=1.0, logit_bias={5: 2.0}),
              SamplingParams(max_tokens=16, temperature=0.0, presence_penalty=1.5, repetition_penalty=1.2, n=2)]
    solo = [run_alone(nanochat_model, tokenizer, p, sp) for p, sp in zip(ps, params)]
    engine = LLMEngine(nanochat_model, tokenizer, max_rows=8)
    for i, (p, sp) in enumerate(zip(ps, params)):
        engine.add_request(p, sp, f"r{i}")
    batched = collect(engine)
    assert [batched[f"r{i}"] for i in range(4)] == solo


def test_forced_calculator_tokens_carry_no_logprobs(tokenizer):
    parts = [("text", "the answer is"), ("special", "<|python_start|>"), ("text", "6*7"),
             ("special", "<|python_end|>"), ("text", " ok"), ("special", "<|assistant_end|>")]
    engine, _ = scripted_engine(tokenizer, parts)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=40, temperature=0.0, logprobs=2), "r")
    events = [ev for _ in range(60) for ev in engine.step() if ev.token is not None]
    forced = [ev for ev in events if ev.forced]
    assert forced and all(ev.logprob is None and ev.top_logprobs is None for ev in forced)
    assert all(ev.logprob is not None for ev in events if not ev.forced)


@pytest.mark.parametrize("kw,field", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": 5e-324}, "repetition_penalty"),
    ({"logit_bias": {1: 101}}, "logit_bias"),
    ({"logit_bias": {-1: 1}}, "logit_bias"), ({"logit_bias": {i: 1 for i in range(301)}}, "logit_bias"),
    ({"logprobs": 21}, "top_logprobs"),
])
def test_invalid_values_name_their_field(kw, field):
    with pytest.raises(SamplingError) as e:
        SamplingParams(**kw)
    assert e.value.param == field


def test_logit_bias_ids_are_checked_against_the_vocabulary(nanochat_model, tokenizer):
    engine = LLMEngine(nanochat_model, tokenizer, max_rows=1)
    with pytest.raises(SamplingError, match="logit_bias"):
        engine.add_request([1, 2], SamplingParams(logit_bias={tokenizer.vocab_size: 1.0}))


def test_extreme_values_in_range_keep_every_number_finite(nanochat_model, tokenizer):
    """The smallest repetition penalty and a vanishing temperature (found by the fuzzer as a 500: NaN logprobs):
    the penalty's tokens stay finite, and a temperature below GREEDY_BELOW samples exactly the greedy tokens."""
    import math

    from core.chat.protocol import MIN_REPETITION_PENALTY

    def run(**kw):
        engine = LLMEngine(nanochat_model, tokenizer, max_rows=1)
        engine.add_request([5, 9, 100, 42, 9], SamplingParams(max_tokens=12, logprobs=3, **kw), "r")
        return [ev for _ in range(30) for ev in engine.step() if ev.token is not None]

    events = run(temperature=1.0, seed=1, repetition_penalty=MIN_REPETITION_PENALTY)
    assert all(math.isfinite(ev.logprob) and all(math.isfinite(lp) for _, lp in ev.top_logprobs) for ev in events)
    tiny = run(temperature=1e-300, seed=1, top_k=5)      # (1e-300 is 0 in float32: logits / 0)
    assert [ev.token for ev in tiny] == [ev.token for ev in run(temperature=0.0)]
    assert all(math.isfinite(ev.logprob) for ev in tiny)
