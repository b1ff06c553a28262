"""The small-row kernel (core/chat/csrc/small_linear.cpp) and weight-only int8 (core/chat/quantized.py), against
torch's own products on the same numbers: fp32 sums of the same terms agree to rounding, a row computes the
same bits alone as in any batch, and an int8 engine generates what the model whose weights are the dequantized
int8 ones generates."""
import pytest
import torch
import torch.nn.functional as F

from core.chat import EngineConfig, LLMEngine, SamplingParams
from core.chat.packed import packs
from core.chat.quantized import Int8Linear, quantize, quantize_linears
from core.chat.small_linear import kernel, small_linear
from tests.conftest import tiny_model
from tests.test_precision import greedy, prompts

pytestmark = pytest.mark.skipif(kernel() is None, reason="the small-row kernel does not build here")


@pytest.mark.parametrize("k", [768, 130, 7])          # whole vectors, a tail, shorter than one vector
@pytest.mark.parametrize("wdtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("xdtype", ["float32", "bfloat16"])
def test_the_kernel_is_torch_product_and_a_row_is_the_same_alone(k, wdtype, xdtype):
    g = torch.Generator().manual_seed(k)
    w = torch.randn(197, k, generator=g)               # 197 outputs: blocks of 64 and a ragged last one
    bias = torch.randn(197, generator=g)
    x = torch.randn(8, k, generator=g).to(getattr(torch, xdtype))
    if wdtype == "int8":
        q, scale = quantize(w)
        reference = (x.double() @ (q.double() * scale.double()[:, None]).T) + bias.double()
        y = small_linear(x, q, scale, bias)
    else:
        wt = w.to(getattr(torch, wdtype))
        reference = x.double() @ wt.double().T + bias.double()
        y = small_linear(x, wt, None, bias)
    assert y.dtype == x.dtype and y.shape == (8, 197)
    # fp32 sums of exactly representable products: rounding of the sum, then of the output dtype
    tol = 2e-5 * k ** 0.5 if xdtype == "float32" else 2 ** -7
    assert ((y.double() - reference).abs() / (reference.abs() + 1)).max().item() <= tol
    for rows in range(1, 9):                           # every batch size gives a row the same bits
        part = small_linear(x[:rows], q if wdtype == "int8" else wt, scale if wdtype == "int8" else None, bias)
        assert torch.equal(part, y[:rows])
    assert torch.equal(small_linear(x[3:4], q if wdtype == "int8" else wt, scale if wdtype == "int8" else None,
                                    bias), y[3:4])


def test_the_kernel_refuses_what_it_cannot_do():
    ext = kernel()
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        ext.small_linear(torch.randn(9, 16), torch.randn(4, 16), None, None)
    with pytest.raises(RuntimeError, match="need their scales"):
        ext.small_linear(torch.randn(1, 16), torch.zeros(4, 16, dtype=torch.int8), None, None)
    with pytest.raises(RuntimeError, match="x \\(M, K\\)"):
        ext.small_linear(torch.randn(1, 16), torch.randn(4, 15), None, None)


def test_quantization_is_per_output_channel_round_to_nearest():
    w = torch.tensor([[0.5, -1.0, 0.25], [100.0, 0.0, -50.0], [0.0, 0.0, 0.0]])
    q, scale = quantize(w)
    assert q.dtype == torch.int8 and torch.equal(q[0], torch.tensor([64, -127, 32], dtype=torch.int8))
    assert torch.equal(q[1], torch.tensor([127, 0, -64], dtype=torch.int8))      # -63.5 rounds to even
    assert torch.equal(q[2], torch.zeros(3, dtype=torch.int8)) and scale[2] > 0
    assert torch.allclose(scale[:2], torch.tensor([1 / 127, 100 / 127]))
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all()


def dequantized_twin(model):
    """The same model with every linear weight replaced by its int8 round trip (q * scale), on torch's F.linear;
    a head tied to the embedding gets a weight of its own (the embedding stays as it was, as in Int8Linear)."""
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            q, scale = quantize(m.weight)
            m.weight = torch.nn.Parameter((q.float() * scale[:, None]).to(m.weight.dtype), requires_grad=False)
    return model


@pytest.mark.parametrize("arch", ["nanochat", "modern", "gpt2"])
def test_an_int8_engine_generates_what_the_dequantized_weights_give(arch, tokenizer):
    """fp32 activations: the int8 engine (the kernel at a few rows, oneDNN on the dequantized copy at more)
    against the fp32 model with the round-tripped weights on F.linear, greedy, batched and draining; the logits
    of a plain pass within 1e-4."""
    model = tiny_model(arch, tokenizer, seed=6, std=0.3)
    twin = dequantized_twin(tiny_model(arch, tokenizer, seed=6, std=0.3))
    ids = torch.randint(0, 500, (3, 20), generator=torch.Generator().manual_seed(2))
    engine = LLMEngine(model, tokenizer, max_rows=12, weights="int8")
    assert engine.linear == "int8"
    assert all(not isinstance(m, torch.nn.Linear) for m in model.modules())
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) > 0
    with torch.no_grad():
        assert (model(ids) - twin(ids)).abs().max().item() <= 1e-4
        assert (model(ids[:1, :1]) - twin(ids[:1, :1])).abs().max().item() <= 1e-4     # one row: the kernel
    ps = prompts(16, seed=5)
    with torch.no_grad():
        got = greedy(engine, ps)
        want = greedy(LLMEngine(twin, tokenizer, max_rows=12, packed_linear=False), ps)
    assert sum(a == b for a, b in zip(got, want)) >= 15


def test_int8_in_bf16_keeps_close_to_bf16(tokenizer):
    """The int8 engine in bf16 against the same model in bf16: the logits' largest difference is of the size of
    bf16's own rounding of the weights, and most greedy sequences agree."""
    base = tiny_model("gpt2", tokenizer, seed=3, std=0.1).to(torch.bfloat16)
    model = tiny_model("gpt2", tokenizer, seed=3, std=0.1).to(torch.bfloat16)
    quantize_linears(model)
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        a, b = base(ids), model(ids)
    assert (a - b).abs().max().item() <= 0.1 * a.abs().max().item()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.9


def test_int8_setting_is_checked():
    with pytest.raises(ValueError, match="weights must be one of"):
        EngineConfig(weights="int4")


@pytest.mark.skipif(not packs(torch.bfloat16), reason="oneDNN does not pack bf16 weights on this CPU")
def test_packed_bf16_layers_take_the_kernel_at_few_rows_only(tokenizer, monkeypatch):
    """bf16 products of up to packed.SMALL_ROWS rows go to the kernel, more rows to oneDNN; the engine's stream is
    the same as with the kernel off except where one rounding flips a near tie (greedy agreement)."""
    import core.chat.packed as packed_module

    monkeypatch.setattr(packed_module, "MIN_WEIGHT", 0)
    monkeypatch.setattr(packed_module, "SMALL_MIN_WEIGHT", 0)
    on = tiny_model("gpt2", tokenizer, seed=6, std=0.3).to(torch.bfloat16)
    off = tiny_model("gpt2", tokenizer, seed=6, std=0.3).to(torch.bfloat16)
    a = LLMEngine(on, tokenizer, max_rows=8)
    b = LLMEngine(off, tokenizer, max_rows=8, small_row_kernel=False)
    lin = on.transformer.h[0].mlp.c_fc
    assert lin.small_rows == packed_module.SMALL_ROWS[torch.bfloat16] > 0
    assert off.transformer.h[0].mlp.c_fc.small_rows == 0
    x = torch.randn(1, lin.in_features).bfloat16()
    with torch.no_grad(), torch.profiler.profile() as prof:
        y = lin(x)
    assert not any("_linear_pointwise" in e.key for e in prof.key_averages())
    with torch.no_grad(), torch.profiler.profile() as prof:
        lin(torch.randn(lin.small_rows + 1, lin.in_features).bfloat16())
    assert any("_linear_pointwise" in e.key for e in prof.key_averages())
    with torch.no_grad():
        assert (y.float() - F.linear(x, lin.weight, lin.bias).float()).abs().max().item() <= 0.05
    ps = prompts(8, seed=9)
    with torch.no_grad():
        got, want = greedy(a, ps), greedy(b, ps)
    assert sum(x == y for x, y in zip(got, want)) >= 6


def test_fp32_layers_take_the_kernel_at_one_and_two_rows(tokenizer, monkeypatch):
    """fp32 products of one or two rows go to the kernel (not MKL's addmm, not oneDNN), to fp32 rounding of
    torch's product; three rows stay on F.linear and from packed.MIN_ROWS on oneDNN's packed product; the engine
    generates what the same model generates with the kernel off."""
    import core.chat.packed as packed_module

    monkeypatch.setattr(packed_module, "MIN_WEIGHT", 0)
    monkeypatch.setattr(packed_module, "SMALL_MIN_WEIGHT", 0)
    on = tiny_model("gpt2", tokenizer, seed=6, std=0.3)
    off = tiny_model("gpt2", tokenizer, seed=6, std=0.3)
    a = LLMEngine(on, tokenizer, max_rows=8)
    b = LLMEngine(off, tokenizer, max_rows=8, small_row_kernel=False)
    lin = on.transformer.h[0].mlp.c_fc
    assert lin.small_rows == packed_module.SMALL_ROWS[torch.float32] == 2
    assert off.transformer.h[0].mlp.c_fc.small_rows == 0
    ops = {}
    for rows in (1, 2, 3, packed_module.MIN_ROWS):
        x = torch.randn(rows, lin.in_features)
        with torch.no_grad(), torch.profiler.profile() as prof:
            y = lin(x)
        ops[rows] = {e.key for e in prof.key_averages()}
        with torch.no_grad():
            want = F.linear(x, lin.weight, lin.bias)
        assert (y - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    assert not {"aten::addmm", "mkldnn::_linear_pointwise"} & (ops[1] | ops[2])
    assert "aten::addmm" in ops[3] and "mkldnn::_linear_pointwise" in ops[packed_module.MIN_ROWS]
    ps = prompts(8, seed=9)
    with torch.no_grad():
        got, want = greedy(a, ps), greedy(b, ps)
    assert sum(x == y for x, y in zip(got, want)) >= 7


def test_chat_weights_int8_reaches_the_engine_a_replica_builds(tmp_path):
    """`chat_weights: int8` in the application's arguments: the chat replica's engine start carries it and the
    engine it builds runs the demo checkpoint's linear layers in int8 and answers; a value it does not know is
    refused with the setting's name."""
    import os

    from core.chat.engine_process import build_engine
    from deployments.chat import ChatModel
    from deployments.settings import AppArgs

    started = []

    class Recorder:
        max_rows = 0
        linear = "torch"

        def __init__(self, start, on_stats=None, hold=None):
            started.append(start)

        def shutdown(self):
            pass

    args = AppArgs.model_validate({"device": "cpu", "chat_weights": "int8", "chat_engine_process": False})
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    demo = args.chat.model_copy(update={"checkpoint": os.path.join(root, "models", "demo-chat")})
    ChatModel.func_or_class(demo, start_engine=Recorder)
    (start,) = started
    assert start.config.weights == "int8"
    threads = torch.get_num_threads()
    try:
        engine = build_engine(start)
    finally:
        torch.set_num_threads(threads)
    assert engine.linear == "int8" and any(isinstance(m, Int8Linear) for m in engine.model.modules())
    engine.add_request(list(start.prefix_ids) + [5, 6, 7], SamplingParams(max_tokens=5, temperature=0.0), "r")
    tokens = []
    while engine.has_work():
        tokens += [ev.token for ev in engine.step() if ev.token is not None]
    assert len(tokens) == 5
    with pytest.raises(ValueError, match="(?s)weights.*'dtype' or 'int8'"):
        AppArgs.model_validate({"chat_weights": "int4"})


@pytest.mark.gpu
def test_int8_on_cuda_generates_what_the_dequantized_weights_give(tokenizer):
    """On CUDA an Int8Linear dequantizes its weight for each product (CUDA graphs record it): in fp32 the int8
    engine's greedy streams, replayed from graphs, are the twin's with the round-tripped weights on F.linear."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model = tiny_model("nanochat", tokenizer, seed=6, std=0.3).cuda()
    twin = dequantized_twin(tiny_model("nanochat", tokenizer, seed=6, std=0.3)).cuda()
    engine = LLMEngine(model, tokenizer, max_rows=8, weights="int8")
    assert engine.linear == "int8" and engine.graphs is not None
    ps = prompts(8, seed=5)
    with torch.no_grad():
        got = greedy(engine, ps)
        want = greedy(LLMEngine(twin, tokenizer, max_rows=8, cuda_graphs=False), ps)
    assert sum(a == b for a, b in zip(got, want)) >= 7
