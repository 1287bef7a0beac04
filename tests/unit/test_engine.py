"""The generation engine: greedy tokens equal transformers' for each family under continuous batching (mixed
prompt lengths, requests joining mid-batch, chunked prefill, prefix-cache hits, preemption forced by a tiny
block pool, sliding windows); seeded sampling is reproducible and independent of the batch; the logits
filters equal transformers' processors; stops, lengths, n > 1, aborts and bad requests."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from shardforge.infer import paged
from shardforge.infer.blocks import BlockManager
from shardforge.infer.cpu_kernels import cpu_kernels
from shardforge.infer.engine import Engine
from shardforge.infer.engine_types import EngineConfig, RequestError
from shardforge.infer.kv_pool import paged_pool
from shardforge.infer.output import OutputProcessor
from shardforge.infer.sampling import (
    GenerationDefaults,
    Sampler,
    SamplingError,
    SamplingParams,
    choose,
    processed_logits,
)
from shardforge.infer.text import TextStream
from shardforge.models import load_model
from shardforge.models.common.config import DecoderConfig
from tests.generate_oracle import generate
from tests.unit.test_generate import FAMILIES, VOCAB, _hf_model, _prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    hf.generation_config.eos_token_id = None
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def _engine(folder, **config) -> Engine:
    return Engine(load_model(folder), config=EngineConfig(**config))


def _run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]], join_after: int) -> dict:
    """Run first completions to the end; the second half of the requests joins after `join_after` steps.
    Returns request id -> tokens."""
    names = list(requests)
    late = names[len(names) // 2 :]
    for name in names[: len(names) // 2]:
        engine.add(name, *requests[name])
    out: dict[str, list[int]] = {name: [] for name in names}
    steps = 0
    while engine.has_work() or late:
        if steps == join_after:
            for name in late:
                engine.add(name, *requests[name])
            late = []
        for update in engine.step():
            out[update.request_id] += update.tokens
        steps += 1
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_tokens_match_transformers_under_continuous_batching(tmp_path, family):
    hf, folder = _hf_model(tmp_path, family)
    prompts = _prompts((5, 11, 20, 3, 17, 9), seed=2)
    expected = [_hf_greedy(hf, p, 20) for p in prompts]
    # Blocks of 4 and 16 tokens a step: prompts prefill in chunks, mixed with other requests' decodes.
    engine = _engine(folder, block_size=4, max_step_tokens=16, num_blocks=64)
    got = _run(engine, {f"r{i}": (p, GREEDY) for i, p in enumerate(prompts)}, join_after=3)
    assert [got[f"r{i}"] for i in range(len(prompts))] == expected
    assert engine.blocks.in_use == 0 and not engine.requests  # everything released


def test_scattered_blocks_keep_greedy_tokens(tmp_path, monkeypatch):
    """Keys read through several pool slices (blocks handed out in random order) attend as one run does."""
    hf, folder = _hf_model(tmp_path, "mistral")  # sliding window 16: decodes slice into the joined runs
    prompts = _prompts((5, 11, 20, 3, 17, 9), seed=2)
    expected = [_hf_greedy(hf, p, 20) for p in prompts]
    engine = _engine(folder, block_size=4, max_step_tokens=16, num_blocks=64)
    rng = np.random.default_rng(0)
    blocks = engine.blocks
    monkeypatch.setattr(blocks, "_run_start", lambda span: int(rng.choice(np.flatnonzero(blocks.free))))
    scattered = blocks.allocate
    monkeypatch.setattr(blocks, "allocate", lambda after=None, span=1: scattered(None, 1))
    most = []
    real_slices = paged._slices
    monkeypatch.setattr(paged, "_slices", lambda *a: most.append(len(real_slices(*a))) or real_slices(*a))
    got = _run(engine, {f"r{i}": (p, GREEDY) for i, p in enumerate(prompts)}, join_after=3)
    assert [got[f"r{i}"] for i in range(len(prompts))] == expected
    assert max(most) >= 4


@pytest.mark.parametrize("prefill", [True, False])
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 4, 16), (8, 1, 128), (71, 1, 80)])  # falcon-7b
def test_decode_kernel_equals_one_sdpa_call_per_sequence(heads, kv_heads, d, prefill):
    """The CPU decode-attention kernel against the SDPA calls it replaces, on one step of decodes (lengths 1
    to 200, some ending mid-block) whose keys are one run of blocks or split over runs (the n completions
    of a prompt: its shared blocks, then their own), two decodes sharing blocks, and a prefill chunk among
    them or not (a step of decodes alone), with queries in the model's layout, on full-attention and
    sliding-window layers."""
    kernel = cpu_kernels()
    assert kernel is not None, "the kernel must build here (a compiler is part of the test machine)"
    generator = torch.Generator().manual_seed(0)
    lengths, size = [1, 5, 16, 17, 63, 200, 129, 40, 90], 8
    chunks, at = [], 0
    for i, n in enumerate(lengths):  # decode the n-th token of a sequence
        blocks = list(range(at, at + -(-n // size)))
        if i % 3 == 2 and len(blocks) > 2:  # split over two runs
            blocks = blocks[:2] + [b + 3 for b in blocks[2:]]
        chunks.append(paged.Chunk(blocks, n - 1, 1))
        at = blocks[-1] + 2
    chunks.append(paged.Chunk([*chunks[-1].blocks[:2], at, at + 1], 29, 1))  # shares the last one's prefix
    lengths.append(30)
    at += 2
    if prefill:
        chunks.append(paged.Chunk(list(range(at, at + 3)), 0, 20))  # a prefill chunk among them
    tokens = len(lengths) + 20 * prefill
    # as the model makes them: projections [1, tokens, heads, d] seen heads first
    q = torch.randn(1, tokens, heads, d, generator=generator).transpose(1, 2)
    k, v = (torch.randn(1, tokens, kv_heads, d, generator=generator).transpose(1, 2) for _ in range(2))
    outs = []
    for fast in (kernel, None):
        kv = paged.PagedKV(at + 4, size, fast)
        pool_k, pool_v = kv.layer(0, k)
        pool_k.copy_(torch.randn(pool_k.shape, generator=torch.Generator().manual_seed(1)))
        pool_v.copy_(torch.randn(pool_v.shape, generator=torch.Generator().manual_seed(2)))
        step = paged.PagedStep(kv, chunks, torch.device("cpu"))
        cfg = DecoderConfig(vocab_size=8, hidden_size=16, intermediate_size=8, num_layers=1, num_heads=heads,
                            num_kv_heads=kv_heads, head_dim=d, sliding_window=12)  # fmt: skip
        step.context(cfg, step.positions)
        outs.append([step.attend(0, q, k, v, sliding) for sliding in (False, True)])
    for ours, loop in zip(outs[0], outs[1], strict=True):
        torch.testing.assert_close(ours, loop, rtol=1e-5, atol=1e-5)


def test_the_pool_is_zeroed_when_the_engine_is_built(tmp_path):
    """Its memory is reserved and zeroed with the engine (as vLLM reserves its cache), not in the first
    step; the layers carve their keys and values from it; one that does not fit gets memory of its own."""
    _, folder = _hf_model(tmp_path, "llama")
    model = load_model(folder)
    cfg = model.config
    kv = paged_pool(model, EngineConfig(block_size=4, num_blocks=10))
    assert kv.arena is not None and not kv.arena.any()
    assert kv.arena.numel() == 2 * 10 * 4 * cfg.num_kv_heads * cfg.head_dim * cfg.num_layers
    like = torch.empty(1, cfg.num_kv_heads, 3, cfg.head_dim)
    storage = kv.arena.untyped_storage().data_ptr()
    for layer in range(cfg.num_layers):
        for pool in kv.layer(layer, like):
            assert pool.shape == (1, cfg.num_kv_heads, 40, cfg.head_dim)
            assert pool.untyped_storage().data_ptr() == storage
    assert kv.carved == kv.arena.numel()
    own = kv.layer(cfg.num_layers, like)[0]  # more layers than the model said: memory of its own
    assert own.untyped_storage().data_ptr() != storage and not own.any()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # an RL rollout's: the stream's dtype is not known yet
        assert paged_pool(model, EngineConfig(block_size=4, num_blocks=10)).arena is None


def test_blocks_come_in_runs_reserved_softly():
    blocks = BlockManager(16, block_size=4)
    a = [blocks.allocate(None, span=6)]  # a sequence that may reach 6 blocks: 1-5 are kept for it
    b = [blocks.allocate(None, span=4)]
    assert a == [0] and b == [6]
    for span in (5, 4):
        a.append(blocks.allocate(a[-1], span))
    b.append(blocks.allocate(b[-1], 3))
    assert a == [0, 1, 2] and b == [6, 7]
    assert paged._slices(a + b, 18, 4) == [(0, 12), (24, 30)]  # two runs; the last block half full
    c = [blocks.allocate(None, span=8) for _ in range(4)]  # no run of 8 left: the longest, then reserved ones
    assert c == [10, 3, 4, 5] and blocks.reserved[11:].all()
    blocks.release(b)  # b's reservation is given up with its blocks
    assert not blocks.reserved[:10].any() and blocks.free_count == 16 - 3 - 4


def test_prefix_cache_hits_and_preemption_keep_greedy_tokens(tmp_path):
    hf, folder = _hf_model(tmp_path, "mistral")  # sliding window 16, crossed by prompt + new tokens
    shared = _prompts((13,), seed=5)[0]
    prompts = [shared + tail for tail in _prompts((3, 6, 1, 9), seed=6)]
    expected = [_hf_greedy(hf, p, 20) for p in prompts]
    engine = _engine(folder, block_size=4, max_step_tokens=64, num_blocks=64)
    assert engine.generate([prompts[0]], GREEDY)[0][0].tokens == expected[0]
    hits = engine.blocks.hits
    got = engine.generate(prompts, GREEDY)
    assert [c[0].tokens for c in got] == expected
    assert engine.blocks.hits - hits >= 3 * 12  # each later prompt found its 3 shared full blocks
    # 9 blocks of 4 slots: two sequences of ~36 tokens cannot both stay, so one is preempted and recomputed.
    small = _engine(folder, block_size=4, max_step_tokens=64, num_blocks=12)
    got = small.generate(prompts, GREEDY)
    assert [c[0].tokens for c in got] == expected
    assert small.scheduler.preemptions > 0
    assert small.blocks.in_use == 0


def test_bf16_engine_matches_bf16_generate(tmp_path):
    """Low precision against the same precision: the paged engine's greedy tokens equal the contiguous-cache
    generate's, both in bf16."""
    _, folder = _hf_model(tmp_path, "qwen2")
    model = load_model(folder, dtype=torch.bfloat16)
    prompts = _prompts((5, 11, 20), seed=2)
    expected = [generate(model, [p], max_new_tokens=12)[0] for p in prompts]
    engine = Engine(model, config=EngineConfig(block_size=4, num_blocks=64, max_step_tokens=16))
    got = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert [c[0].tokens for c in got] == expected
    assert engine.executor.runner.kv.keys[0].dtype == torch.bfloat16


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(tmp_path):
    _, folder = _hf_model(tmp_path, "llama")
    engine = _engine(folder, block_size=4, max_step_tokens=32, num_blocks=128)
    prompts = _prompts((7, 12, 4, 15), seed=9)
    seeded = SamplingParams(temperature=1.5, top_p=0.95, seed=123, max_tokens=16, ignore_eos=True)
    alone = engine.generate([prompts[0]], seeded)[0][0].tokens
    again = engine.generate([prompts[0]], seeded)[0][0].tokens
    others = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
    crowded = engine.generate(prompts, [seeded, others, others, others])[0][0].tokens
    assert alone == again == crowded
    other_seed = engine.generate([prompts[0]], SamplingParams(**{**seeded.__dict__, "seed": 124}))[0][0]
    assert other_seed.tokens != alone


def test_n_completions_share_the_prompt_blocks(tmp_path):
    hf, folder = _hf_model(tmp_path, "llama")
    engine = _engine(folder, block_size=4, max_step_tokens=64, num_blocks=64)
    prompt = _prompts((18,), seed=4)[0]
    params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=8, ignore_eos=True)
    (completions,) = engine.generate([prompt], params)
    assert len(completions) == 3 and len({tuple(c.tokens) for c in completions}) > 1
    assert engine.blocks.hits >= 2 * 16  # the two later completions reused the 4 full prompt blocks
    greedy = engine.generate([prompt], SamplingParams(temperature=0.0, n=2, max_tokens=8, ignore_eos=True))
    assert greedy[0][0].tokens == greedy[0][1].tokens == _hf_greedy(hf, prompt, 8)


def test_stop_tokens_min_and_max_tokens(tmp_path):
    hf, folder = _hf_model(tmp_path, "llama")
    prompt = _prompts((6,), seed=1)[0]
    free = _hf_greedy(hf, prompt, 20)
    stop = free[5]
    engine = _engine(folder, block_size=4, num_blocks=32)
    done = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=(stop,)))
    first = free.index(stop)
    assert done[0][0].tokens == free[: first + 1] and done[0][0].finish_reason == "stop"
    capped = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3))[0][0]
    assert capped.tokens == free[:3] and capped.finish_reason == "length"
    late = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=first + 2, stop_token_ids=(stop,))
    assert stop not in engine.generate([prompt], late)[0][0].tokens[: first + 2]


def test_abort_frees_blocks_and_bad_requests_are_clear(tmp_path):
    _, folder = _hf_model(tmp_path, "llama")  # context 256
    engine = _engine(folder, block_size=4, num_blocks=16)
    engine.add("a", [1, 2, 3, 4, 5], GREEDY)
    engine.step()
    assert engine.blocks.in_use == 2
    engine.abort("a")
    assert engine.blocks.in_use == 0 and not engine.has_work()
    with pytest.raises(RequestError, match="context of 256"):
        engine.add("b", [1] * 250, SamplingParams(max_tokens=10))
    with pytest.raises(RequestError, match="64 slots"):
        engine.add("c", [1] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(SamplingError, match=r"top_p=1\.5"):
        engine.add("d", [1], SamplingParams(top_p=1.5))
    engine.add("e", [1], GREEDY)
    with pytest.raises(RequestError, match="already running"):
        engine.add("e", [1], GREEDY)


def test_logprobs_are_the_models(tmp_path):
    _, folder = _hf_model(tmp_path, "qwen2")
    model = load_model(folder).eval()
    engine = Engine(model, config=EngineConfig(block_size=4, num_blocks=32))
    prompt = _prompts((9,), seed=8)[0]
    done = engine.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True)
    )
    tokens = done[0][0].tokens
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens]))[0, len(prompt) - 1 : -1].log_softmax(-1)
    for (chosen, top), token, row in zip(done[0][0].logprobs, tokens, logits, strict=True):
        assert math.isclose(chosen, row[token].item(), abs_tol=1e-5)
        assert [t for t, _ in top] == row.topk(3).indices.tolist() and top[0][0] == token


# ---- the sampler against transformers' processors ---------------------------------------------------------
@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.7, top_k=5),
        dict(temperature=1.3, top_p=0.8),
        dict(temperature=1.0, min_p=0.1),
        dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
    ],
)
def test_filters_equal_transformers_processors(params):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(VOCAB, generator=generator) * 3
    history = [3, 3, 17, 40, 99]
    ours = processed_logits(logits[None], [Sampler.create(SamplingParams(**params).check())], [history])[0]
    scores = logits[None].clone()
    ids = torch.tensor([history])
    if "repetition_penalty" in params:
        scores = RepetitionPenaltyLogitsProcessor(params["repetition_penalty"])(ids, scores)
    scores = TemperatureLogitsWarper(params["temperature"])(ids, scores)
    for key, warper in (
        ("top_k", TopKLogitsWarper),
        ("top_p", TopPLogitsWarper),
        ("min_p", MinPLogitsWarper),
    ):
        if key in params:
            scores = warper(params[key])(ids, scores)
    assert torch.equal(torch.isinf(ours), torch.isinf(scores[0]))
    kept = ~torch.isinf(ours)
    torch.testing.assert_close(ours[kept], scores[0][kept], rtol=1e-6, atol=1e-6)


def test_a_row_sampled_in_a_batch_equals_the_row_alone():
    """The batched sampler (one call for every row of a step, on the logits' device) gives each row exactly
    what it gives the row alone: the filtered logits bit for bit, and the same draws from the same seeds."""
    settings = [
        dict(temperature=0.0),
        dict(temperature=0.7, top_k=5, seed=1),
        dict(temperature=1.3, top_p=0.8, seed=2),
        dict(temperature=1.0, min_p=0.1, seed=3),
        dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.3, seed=4),
        dict(temperature=0.0, presence_penalty=0.5, logit_bias=((7, 100.0),)),
        dict(temperature=1.0, seed=5),
    ]
    logits = torch.randn(len(settings), VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    history = [3, 3, 17, 40, 99]

    def samplers():
        return [Sampler.create(SamplingParams(**p).check(), index=0) for p in settings]

    together, alone = samplers(), samplers()
    batch = processed_logits(logits, together, [history] * len(settings), [(1, 2)] * len(settings))
    tokens = choose(batch, together)
    for row, sampler in enumerate(alone):
        one = processed_logits(logits[row : row + 1], [sampler], [history], [(1, 2)])
        assert torch.equal(one[0], batch[row])
        assert choose(one, [sampler]) == [tokens[row]]
    assert tokens[5] == 7  # the logit bias applied to a greedy row


def test_draws_follow_the_filtered_distribution():
    """An independent top-p: keep the most likely tokens until their mass reaches p; the draws' frequencies
    match the renormalized probabilities."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0])
    probs = logits.softmax(-1)
    order = probs.argsort(descending=True)
    kept, mass = [], 0.0
    for token in order.tolist():
        if mass >= 0.8:
            break
        kept.append(token)
        mass += probs[token].item()
    expected = torch.zeros_like(probs)
    expected[kept] = probs[kept] / probs[kept].sum()
    sampler = Sampler.create(SamplingParams(temperature=1.0, top_p=0.8, seed=0).check())
    counts = torch.zeros_like(probs)
    for _ in range(4000):
        counts[choose(processed_logits(logits[None], [sampler]), [sampler])[0]] += 1
    assert torch.all(counts[expected == 0] == 0)
    torch.testing.assert_close(counts / 4000, expected, atol=0.025, rtol=0)


def test_penalties_and_defaults():
    logits = torch.zeros(10)
    sampler = Sampler.create(SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25))
    for token in (2, 2, 5):
        sampler.observe(token)
    x = processed_logits(logits[None], [sampler])[0]
    assert x[2].item() == -1.0 and x[5].item() == -0.75 and x[0].item() == 0.0
    defaults = GenerationDefaults({"temperature": 0.6, "top_p": 0.9}, (2,))
    filled = defaults.fill(SamplingParams(top_p=0.5))
    assert (filled.temperature, filled.top_p) == (0.6, 0.5)
    assert GenerationDefaults().fill(SamplingParams()).temperature == 1.0


class _Letters:
    """A tokenizer whose token i is one letter."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_stop_strings_are_cut_and_never_streamed():
    stream = TextStream(_Letters(), stop=("cde",))
    pieces = []
    ids = []
    for token in [0, 1, 2, 3, 4, 5]:  # a b c d e f
        ids.append(token)
        stream.update(ids)
        pieces.append(stream.delta(final=stream.stopped is not None))
        if stream.stopped:
            break
    assert "".join(pieces) == "ab" and stream.stopped == "cde" and pieces[:2] == ["", ""]


def test_output_processor_ends_a_completion_at_its_stop_string(tmp_path):
    """Detokenizing outside the engine (a server's output thread): the stop string is found in the text of
    the token that completes it, that completion is finished in the engine at once (no more tokens, its
    blocks freed), the other completion of the request runs on, and the request is done when both are."""
    _, folder = _hf_model(tmp_path, "llama")
    engine = Engine(load_model(folder), _Letters(), EngineConfig(block_size=4, num_blocks=64))
    engine.detokenize = False
    prompt = _prompts((6,), seed=1)[0]
    free = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0][0]
    text = _Letters().decode(free.tokens)
    stop = text[5:7]
    first = text.index(stop)  # the token that completes the stop string's first occurrence
    output = OutputProcessor(_Letters())
    params = SamplingParams(temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True, stop=(stop,), n=2)
    output.start("r", engine.add("r", prompt, params))  # top_k 1: both completions are the greedy one
    pieces: dict[int, str] = {0: "", 1: ""}
    made, done = 0, []
    while engine.has_work():
        processed = output.process(engine.step())
        for request_id, index in processed.stopped:
            engine.finish(request_id, index)
        for u in processed.updates:
            pieces[u.index] += u.text
            made += len(u.tokens)
            assert u.finish_reason in (None, "stop")
        done += processed.done
    assert pieces == {0: text[:first], 1: text[:first]} and done == ["r"]
    assert made == 2 * (first + len(stop))  # not one token past the stop string
    assert engine.blocks.in_use == 0 and not engine.requests


def test_stop_strings_count_from_min_tokens_on(tmp_path):
    """As vLLM: before min_tokens a stop string does not end the completion (stop tokens are suppressed
    until then too); the first occurrence that ends at or after the min_tokens-th token does."""
    _, folder = _hf_model(tmp_path, "llama")
    engine = Engine(load_model(folder), _Letters(), EngineConfig(block_size=4, num_blocks=64))
    prompt = _prompts((6,), seed=1)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    text = engine.generate([prompt], greedy)[0][0].text
    stop = text[2:4]
    for min_tokens in (0, 5, 12):
        done = engine.generate([prompt], replace(greedy, stop=(stop,), min_tokens=min_tokens))[0][0]
        ends = [at for at in range(len(text)) if text.startswith(stop, at) and at + len(stop) >= min_tokens]
        expected = (text[: ends[0]], "stop") if ends else (text, "length")
        assert (done.text, done.finish_reason) == expected, min_tokens
