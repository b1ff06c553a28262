"""Model math against transformers' own implementations, and the KV-cache path against a plain forward."""
import pytest
import torch

from core.chat.convert import hf_gpt2
from core.chat.kv_cache import CacheBatch, KVCache, LayerGroups
from core.chat.packed import PackedLinear, pack_linears
from tests.conftest import tiny_model


def to_hf_nanochat(model):
    from transformers import NanoChatConfig, NanoChatForCausalLM

    c = model.config
    hf = NanoChatForCausalLM(NanoChatConfig(
        vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=4 * c.n_embd, num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head, max_position_embeddings=c.sequence_len,
        rms_norm_eps=c.rms_norm_eps, final_logit_softcapping=c.logit_softcap,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta}))
    sd = {"model.embed_tokens.weight": model.transformer.wte.weight, "lm_head.weight": model.lm_head.weight}
    for i, block in enumerate(model.transformer.h):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = block.attn.c_q.weight
        sd[p + "self_attn.k_proj.weight"] = block.attn.c_k.weight
        sd[p + "self_attn.v_proj.weight"] = block.attn.c_v.weight
        sd[p + "self_attn.o_proj.weight"] = block.attn.c_proj.weight
        sd[p + "mlp.fc1.weight"] = block.mlp.c_fc.weight
        sd[p + "mlp.fc2.weight"] = block.mlp.c_proj.weight
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and not [k for k in missing if "rotary" not in k]
    return hf.eval()


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "torch-linear"])
@pytest.mark.parametrize("arch", ["nanochat", "gpt2"])
def test_logits_match_transformers(arch, packed, tokenizer):
    """Both ways of running the linear layers: oneDNN's packed weights (what the engine runs on the CPU for
    products of packed.MIN_ROWS-MAX_ROWS rows: 3 x 20 positions here) and torch's F.linear."""
    model = tiny_model(arch, tokenizer, seed=3, std=0.1)
    hf = to_hf_nanochat(model) if arch == "nanochat" else hf_gpt2(model)
    if packed:
        assert pack_linears(model, min_weight=0) > 0
    ids = torch.randint(0, tokenizer.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.profiler.profile() as prof:
        ours = model(ids)
    with torch.no_grad():
        theirs = hf(ids).logits
    ran_packed = any("_linear_pointwise" in e.key for e in prof.key_averages())
    assert ran_packed == packed
    assert ours.shape == (3, 20, tokenizer.vocab_size)
    assert (ours - theirs).abs().max().item() <= 1e-4


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("arch", ["nanochat", "modern", "gpt2"])
def test_cache_forward_matches_plain_forward_through_blocks(arch, block_size, tokenizer):
    """Token-by-token decoding through a paged cache must equal one causal pass: each sequence's blocks, one
    table per layer group (the current architecture's window layers in groups of their own), lie scattered over
    the pool in no order."""
    model = tiny_model(arch, tokenizer, seed=4, std=0.1)
    ids = torch.randint(0, tokenizer.vocab_size, (2, 50), generator=torch.Generator().manual_seed(1))
    n = -(-50 // block_size)
    groups = len(LayerGroups.of(model.config.layer_windows))
    cache = KVCache.for_model(model.config, n_blocks=1 + 2 * groups * n, block_size=block_size)
    ids_in_pool = torch.randperm(2 * groups * n, generator=torch.Generator().manual_seed(2)).add(1).tolist()
    tables = [[ids_in_pool[(e * groups + g) * n:(e * groups + g + 1) * n] for g in range(groups)] for e in range(2)]
    cache.touch(1 + 2 * groups * n)
    with torch.no_grad():
        full = model(ids)
        prefix = 5
        out = [model(ids[:, :prefix], CacheBatch.build(cache, tables, [0, 0], prefix))]
        for t in range(prefix, 50):
            out.append(model(ids[:, t:t + 1], CacheBatch.build(cache, tables, [t, t], 1, ids[:, t - 1].tolist())))
    stepped = torch.cat(out, dim=1)
    assert (stepped - full).abs().max().item() <= 1e-4


def test_rows_at_different_positions(tokenizer, any_nanochat):
    """One batched pass with rows at different positions equals each row decoded on its own."""
    model = any_nanochat
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(0, 500, (1, 12), generator=g), torch.randint(0, 500, (1, 30), generator=g)
    with torch.no_grad():
        ref_a, ref_b = model(a)[0, -1], model(b)[0, -1]
        cache = KVCache.for_model(model.config, n_blocks=64, block_size=8)
        ta, tb = cache.tables(2, 32)
        model(a[:, :-1], CacheBatch.build(cache, [ta], [0], 11))
        model(b[:, :-1], CacheBatch.build(cache, [tb], [0], 29))
        step = model(torch.cat([a[:, -1:], b[:, -1:]]),
                     CacheBatch.build(cache, [ta, tb], [11, 29], 1, [a[0, -2].item(), b[0, -2].item()]))
    assert (step[0, 0] - ref_a).abs().max() <= 1e-4
    assert (step[1, 0] - ref_b).abs().max() <= 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["nanochat", "modern", "gpt2"])
def test_cuda_bf16_cache_decode_tracks_fp32(arch, tokenizer):
    """On CUDA in bf16, cached decoding stays close to the fp32 CPU reference and agrees on the argmax mostly."""
    model = tiny_model(arch, tokenizer, seed=6, std=0.1)
    ids = torch.randint(0, tokenizer.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(ids)
        gpu = tiny_model(arch, tokenizer, seed=6, std=0.1).to("cuda", torch.bfloat16)
        cache = KVCache.for_model(gpu.config, n_blocks=64, block_size=8, dtype=torch.bfloat16, device="cuda")
        tables = cache.tables(2, 40)
        out = [gpu(ids[:, :1].cuda(), CacheBatch.build(cache, tables, [0, 0], 1))]
        for t in range(1, 40):
            out.append(gpu(ids[:, t:t + 1].cuda(), CacheBatch.build(cache, tables, [t, t], 1, ids[:, t - 1].tolist())))
    got = torch.cat(out, 1).cpu()
    assert (got - ref).abs().max().item() < 0.25
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.9


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["nanochat", "gpt2"])
def test_cuda_attention_avoids_cudnn(arch, tokenizer):
    """Decoding on CUDA never runs cuDNN's attention (it plans anew for every key length: docs/architecture.md);
    prefill and decode still run through the other SDPA kernels."""
    from torch.profiler import ProfilerActivity, profile

    gpu = tiny_model(arch, tokenizer, seed=6, std=0.1).to("cuda", torch.bfloat16)
    cache = KVCache.for_model(gpu.config, n_blocks=8, block_size=8, dtype=torch.bfloat16, device="cuda")
    tables = cache.tables(2, 12)
    ids = torch.randint(0, tokenizer.vocab_size, (2, 12), device="cuda")
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        gpu(ids[:, :8], CacheBatch.build(cache, tables, [0, 0], 8))
        for t in range(8, 12):
            gpu(ids[:, t:t + 1], CacheBatch.build(cache, tables, [t, t], 1))
        gpu(ids)                                    # the causal pass without a cache
    names = {e.key for e in prof.key_averages()}
    assert "aten::scaled_dot_product_attention" in names
    assert not any("cudnn_attention" in n for n in names), sorted(n for n in names if "attention" in n)


@pytest.mark.parametrize("arch", ["nanochat", "gpt2"])
def test_packing_keeps_parameters_ties_and_checkpoints(arch, tokenizer):
    """Every linear layer is packed; the parameters are the same objects (the GPT-2 head stays tied to the
    embedding), the state_dict keys and values do not change, and a product that needs gradients goes the
    plain way."""
    model = tiny_model(arch, tokenizer, seed=5, std=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = {id(p) for p in model.parameters()}
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert pack_linears(model, min_weight=0) == linears
    assert all(type(m) is PackedLinear for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert {id(p) for p in model.parameters()} == params
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    if arch == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight
    x = torch.randn(3, model.config.n_embd, requires_grad=True)
    lin = next(m for m in model.modules() if isinstance(m, PackedLinear))
    lin(x).sum().backward()                     # the packed op has no backward: this went through F.linear
    assert x.grad is not None and lin.weight.grad is not None
