"""Generation with the KV cache: greedy tokens equal transformers' for each family, the cached forward equals
the plain one, pipeline parts chain to the whole model, and batching left-padded prompts changes nothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from shardforge.models import load_model
from shardforge.models.common.attention import sdpa
from shardforge.models.head import Hidden
from shardforge.models.llama.model import MLP, Decoder
from shardforge.models.presets import preset_config
from tests.generate_oracle import KVCache, generate

VOCAB = 128
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)
FAMILIES = {
    "llama": {},
    # A window shorter than prompt + new tokens, so generation crosses it.
    "mistral": dict(sliding_window=16),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": {},  # with its q/k norms
    # Mixtures of experts: 8 experts, top 2; Qwen2-MoE with its shared expert and a dense first layer
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=64,
        mlp_only_layers=[0],
    ),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True),
}
PROMPT_LENGTHS = (5, 11, 20)


def _hf_model(tmp_path, family: str):
    """A small random HF model of the family, saved to a folder. Every weight is redrawn from a seeded
    generator, large enough that logits are peaked (no near-ties for greedy decoding to fall on), with
    norms and biases away from 1 and 0 so a missed one shows."""
    cfg = AutoConfig.for_model(family, **SHAPE, **FAMILIES[family])
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.5 * noise)
            else:
                p.copy_(0.15 * noise)
    folder = tmp_path / f"hf_{family}"
    hf.save_pretrained(folder)
    return hf, folder


def _prompts(lengths=PROMPT_LENGTHS, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def _hf_generate(hf, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy generation over the left-padded batch; no eos (every row runs to the end)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    hf.generation_config.eos_token_id = None  # the config's default eos (2 for llama) must not stop a row
    out = hf.generate(
        ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
    )
    assert out.shape == (len(prompts), width + max_new_tokens)
    return out[:, width:].tolist()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_tokens_match_transformers(tmp_path, family):
    hf, folder = _hf_model(tmp_path, family)
    ours = load_model(folder)
    prompts = _prompts()
    expected = _hf_generate(hf, prompts, 32)
    assert generate(ours, prompts, max_new_tokens=32) == expected
    assert len({tuple(row) for row in expected}) == 3  # the rows really differ


@pytest.mark.parametrize("family", ["mistral", "qwen3"])
def test_cached_forward_equals_plain_forward(tmp_path, family):
    """A prefill of 10 tokens (queries after none), then a chunk of 6 (queries after cached keys: the
    case SDPA's top-left `is_causal` gets wrong), then one token at a time, past the sliding window."""
    _, folder = _hf_model(tmp_path, family)
    model = load_model(folder).eval()
    ids = torch.tensor(_prompts((40, 40), seed=3))
    positions = torch.arange(40).expand(2, 40)
    cache = KVCache(max_len=48)
    with torch.no_grad():
        expected = model(ids)
        chunks = [(0, 10), (10, 16)] + [(t, t + 1) for t in range(16, 40)]
        got = torch.cat([model(ids[:, a:b], positions[:, a:b], cache=cache) for a, b in chunks], dim=1)
    assert cache.filled == 40
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_cache_overflow_is_clear_error(tmp_path):
    _, folder = _hf_model(tmp_path, "llama")
    model = load_model(folder).eval()
    cache = KVCache(max_len=4)
    with torch.no_grad(), pytest.raises(ValueError, match="holds 4 positions"):
        model(torch.ones(1, 5, dtype=torch.long), cache=cache)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # untied and tied embedding
def test_chained_parts_equal_the_whole_model(tmp_path, family):
    _, folder = _hf_model(tmp_path, family)
    model = load_model(folder).eval()
    first = model.part([0], first=True, last=False)
    last = model.part([0, 1], first=True, last=True).part([1], first=False, last=True)  # from a ModuleDict
    ids = torch.tensor(_prompts((12, 12)))
    with torch.no_grad():
        stream = first(ids)
        assert stream.shape == (2, 12, 64)
        assert torch.equal(last(stream), model(ids))
    # Views: the same parameter objects under the whole model's names, nothing allocated.
    whole = dict(model.named_parameters(remove_duplicate=False))  # a tied head is listed under its name
    for part in (first, last):
        for name, param in part.named_parameters():
            assert param is whole[name]
    assert {n for p in (first, last) for n, _ in p.named_parameters()} == set(whole)
    assert first.lm_head is None and first.norm is None and last.embed_tokens is None
    assert list(last.layers) == ["1"] and last.inv_freq is model.inv_freq
    assert type(first).forward is type(model).forward


def test_the_mlp_is_pluggable():
    cfg = preset_config("tiny-llama", VOCAB)
    built = []

    def mlp(cfg, layer: int) -> nn.Module:
        built.append(layer)
        return nn.Identity() if layer == 1 else MLP(cfg)

    model = Decoder(cfg, mlp=mlp)
    assert built == [0, 1] and isinstance(model.layers[1].mlp, nn.Identity)
    assert model(torch.ones(1, 4, dtype=torch.long)).shape == (1, 4, VOCAB)


def test_return_hidden_feeds_the_head(tmp_path):
    _, folder = _hf_model(tmp_path, "qwen3")
    model = load_model(folder).eval()
    ids = torch.tensor(_prompts((9, 9)))
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[:, 4:] = True
    with torch.no_grad():
        hidden = model(ids, head=Hidden())
        assert hidden.shape == (2, 9, 64)
        assert torch.equal(model.lm_head(hidden), model(ids))
        picked = model(ids, output_mask=mask, head=Hidden())
        assert picked.shape == (10, 64)
        assert torch.equal(picked, hidden[mask])
        assert torch.equal(model.lm_head(picked), model(ids, output_mask=mask))


def test_batched_rows_match_each_row_alone(tmp_path):
    """Left padding and per-row positions make a row's tokens independent of the others in its batch
    (with a window shorter than the longest row)."""
    _, folder = _hf_model(tmp_path, "mistral")
    model = load_model(folder)
    prompts = _prompts((3, 9, 26))
    batched = generate(model, prompts, max_new_tokens=12)
    assert batched == [generate(model, [p], max_new_tokens=12)[0] for p in prompts]


def test_a_row_stops_at_eos_and_the_others_go_on(tmp_path):
    _, folder = _hf_model(tmp_path, "llama")
    model = load_model(folder)
    prompts = _prompts()
    free = generate(model, prompts, max_new_tokens=16)
    eos = free[0][3]
    stopped = generate(model, prompts, max_new_tokens=16, eos_token_id=eos)
    for row, full in zip(stopped, free, strict=True):
        expected = full[: full.index(eos) + 1] if eos in full else full
        assert row == expected  # up to and including the first eos
    assert len(stopped[0]) <= 4


@pytest.mark.parametrize("masked", [False, True])
def test_grouped_query_sdpa_equals_repeated_heads(masked):
    """`sdpa` shares K/V heads through SDPA's enable_gqa: the same result as repeating them per query head
    (what the model did before), causal or with a mask of more keys than queries (decoding with a cache)."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, n, 16, generator=generator) for heads, n in ((8, 5), (2, 9), (2, 9)))
    if masked:
        mask = torch.rand(2, 1, 5, 9, generator=generator) < 0.7
        mask[..., 0] = True
    else:
        mask, k, v = None, k[:, :, :5], v[:, :, :5]
    repeated = F.scaled_dot_product_attention(
        q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), attn_mask=mask, is_causal=mask is None
    )
    torch.testing.assert_close(sdpa(q, k, v, mask), repeated, rtol=0, atol=1e-6)
