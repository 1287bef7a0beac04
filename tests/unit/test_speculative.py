"""Speculative decoding: greedy tokens equal plain decoding's token for token (prompt lookup and a draft
model; n > 1, stop tokens, max_tokens ending mid-draft, penalties, preemption), the rejection sampler keeps
the target's distribution (for any p and q, and for prompt lookup's point masses), seeded requests do not
depend on the batch, and bad settings are refused naming the flag."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from shardforge.errors import ConfigError
from shardforge.infer.engine import Engine
from shardforge.infer.engine_types import EngineConfig
from shardforge.infer.sampling import SamplingParams
from shardforge.infer.speculative import Draft, SpeculativeConfig, lookup, same_vocabulary, verify
from shardforge.models import load_model
from tests.unit.test_generate import _hf_model, _prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
NGRAM = SpeculativeConfig("ngram", num_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)


def _prompts_with_repeats() -> list[list[int]]:
    """Prompts whose tails occur earlier in them, so prompt lookup finds drafts."""
    a, b, c = _prompts((7, 5, 9), seed=3)
    return [a + b + a, c + a + c[:4], b * 3, a + c]


def _tokens(engine: Engine, prompts, params) -> list[list[list[int]]]:
    return [[c.tokens for c in completions] for completions in engine.generate(prompts, params)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return _hf_model(tmp_path_factory.mktemp("spec"), "llama")[1]


def test_lookup_finds_the_first_match_of_the_longest_ngram():
    assert lookup([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 1, 3, 2) == [9, 1]
    assert lookup([5, 6, 5, 8, 6], 1, 3, 4) == [5, 8, 6]  # only a 1-gram matches
    assert lookup([1, 2, 3], 2, 3, 4) == []
    assert lookup([4, 4], 1, 1, 3) == [4]


@pytest.mark.parametrize("draft", ["ngram", "same", "small"])
def test_greedy_tokens_equal_plain_decoding(folder, tmp_path, draft):
    model = load_model(folder)
    config = EngineConfig(block_size=4, num_blocks=128, max_step_tokens=64)
    prompts = _prompts_with_repeats()
    params = [
        GREEDY,
        replace(GREEDY, n=2, max_tokens=13),  # n > 1; 13 ends mid-draft
        replace(GREEDY, stop_token_ids=(7, 11, 19, 23, 31, 44, 57, 60, 77, 90)),
        replace(GREEDY, repetition_penalty=1.3, presence_penalty=0.5, logit_bias=((5, 3.0),), min_tokens=5),
    ]
    plain = _tokens(Engine(model, config=config), prompts, params)
    if draft == "ngram":
        spec = Engine(model, config=replace(config, speculative=NGRAM))
    else:
        other = model if draft == "same" else _near(folder)
        spec_config = replace(config, speculative=SpeculativeConfig("draft", num_tokens=3))
        spec = Engine(model, config=spec_config, draft=other)
    assert _tokens(spec, prompts, params) == plain
    stats = spec.stats()
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens > 0
    if draft == "same":  # the target as its own draft: every greedy draft token is kept (no penalties)
        again = Engine(model, config=spec_config, draft=model)
        again.generate(prompts, replace(GREEDY, n=2))
        assert again.stats().spec_accepted_tokens == again.stats().spec_draft_tokens > 0
    assert spec.blocks.in_use == 0 and not spec.has_work()
    if draft != "ngram":
        assert spec.proposer.blocks.in_use == 0 and not spec.proposer.cached


def _near(folder, noise: float = 0.03):
    """A draft model near the target: its weights with noise (it guesses right often, not always)."""
    draft = load_model(folder)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(noise * torch.randn(p.shape, generator=generator))
    return draft


def test_preemption_keeps_greedy_tokens(folder):
    model = load_model(folder)
    prompts = _prompts_with_repeats()
    params = replace(GREEDY, max_tokens=30)
    plain = _tokens(Engine(model, config=EngineConfig(block_size=4, num_blocks=256)), prompts, params)
    small = Engine(model, config=EngineConfig(block_size=4, num_blocks=20, speculative=NGRAM))
    assert _tokens(small, prompts, params) == plain
    assert small.scheduler.preemptions > 0
    assert small.stats().spec_accepted_tokens > 0


def _first_tokens(p: torch.Tensor, q: torch.Tensor | None, draws: int) -> torch.Tensor:
    """The empirical distribution of the first token `verify` emits, the draft drawn from q (None: always
    token 0, a point mass)."""
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(p.shape[-1], dtype=torch.float64)
    for _ in range(draws):
        if q is None:
            draft, dq = [0, 1], None
        else:
            draft = torch.multinomial(q, 1, generator=generator)[:, 0].tolist()
            dq = q
        tokens, _ = verify(p, draft, dq, generator)
        counts[tokens[0]] += 1
    return counts / draws


@pytest.mark.parametrize("point_mass", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(point_mass):
    """The first emitted token's distribution is p whatever q is (total variation within sampling noise:
    about sqrt(vocab / draws) = 0.016 here)."""
    generator = torch.Generator().manual_seed(1)
    p = torch.softmax(2 * torch.randn(3, 6, generator=generator, dtype=torch.float64), -1)
    p[:, 4] = 0.0  # a token the target never takes (a filter cut it)
    p = p / p.sum(-1, keepdim=True)
    q = (
        None
        if point_mass
        else torch.softmax(2 * torch.randn(2, 6, generator=generator, dtype=torch.float64), -1)
    )
    empirical = _first_tokens(p, q, 20000)
    assert 0.5 * (empirical - p[0]).abs().sum() < 0.03
    assert empirical[4] == 0.0


def test_rejection_sampling_emits_the_bonus_from_the_last_row():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    tokens, accepted = verify(p, [1, 2], None, torch.Generator().manual_seed(0))
    assert (tokens, accepted) == ([1, 2, 0], 2)
    assert verify(p, [1, 0], None, None) == ([1, 2], 1)  # greedy: the first wrong guess is replaced


def test_seeded_sampling_does_not_depend_on_the_batch(folder):
    model = load_model(folder)
    config = EngineConfig(block_size=4, num_blocks=256, speculative=NGRAM)
    prompts = _prompts_with_repeats()
    seeded = SamplingParams(temperature=0.8, top_k=20, max_tokens=20, seed=7, ignore_eos=True)
    alone = _tokens(Engine(model, config=config), prompts[:1], seeded)[0]
    others = SamplingParams(temperature=1.0, max_tokens=17, ignore_eos=True)
    batch = Engine(model, config=config).generate(prompts, [seeded, others, others, others])
    assert [c.tokens for c in batch[0]] == alone


class _Fixed:
    """A proposer of the same tokens every time, as point masses (prompt lookup's kind of draft)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def propose(self, seqs, limits):
        return [Draft(self.tokens[:k]) for k in limits]

    def drop(self, seq):
        pass


def _homogeneous(a: torch.Tensor, b: torch.Tensor) -> float:
    """The p-value of a chi-square test that two samples' counts over the same categories come from one
    distribution (Wilson-Hilferty's normal approximation of the chi-square tail)."""
    seen = (a + b) > 0
    a, b = a[seen].double(), b[seen].double()
    na, nb = a.sum(), b.sum()
    stat = float((((a * (nb / na).sqrt() - b * (na / nb).sqrt()) ** 2) / (a + b)).sum())
    df = max(1, int(seen.sum()) - 1)
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


_PLAIN: dict = {}


@pytest.mark.parametrize("method", ["point", "draft"])
def test_sampled_tokens_keep_the_target_distribution_in_the_engine(folder, method):
    """The second and third new tokens (the first drafted ones) over many seeds, with and without
    speculation, top-k 3: the samples pass a chi-square test of one distribution (p > 0.001). Point-mass
    drafts (a fixed guess, as prompt lookup makes) and a draft model's sampled ones."""
    model = load_model(folder)
    prompt = _prompts_with_repeats()[0]
    # 4 requests of n = 80 (each completion its own generator): one prefill each, decodes batched
    params = [
        SamplingParams(temperature=1.0, top_k=3, max_tokens=3, seed=s, n=80, ignore_eos=True)
        for s in range(4)
    ]

    def later(spec: SpeculativeConfig | None, guess: list[int] | None = None) -> torch.Tensor:
        config = EngineConfig(block_size=4, num_blocks=8192, max_running=500, max_step_tokens=8192)
        draft = _near(folder, 0.02) if spec is not None and spec.method == "draft" else None
        engine = Engine(model, config=replace(config, speculative=spec), draft=draft)
        if guess is not None:
            engine.proposer = _Fixed(guess)
        out = engine.generate([prompt] * len(params), params)
        tokens = torch.tensor([c.tokens for completions in out for c in completions])
        if spec is not None:
            stats = engine.stats()
            assert stats.spec_drafts == len(tokens)
            assert 0.05 * len(tokens) < stats.spec_accepted_tokens < stats.spec_draft_tokens
        return tokens

    plain = _PLAIN.get(folder)
    if plain is None:  # the same for both parametrizations
        plain = _PLAIN[folder] = later(None)
    if method == "point":  # the guesses: the likeliest second and third tokens
        guess = [int(torch.bincount(plain[:, i]).argmax()) for i in (1, 2)]
        drafted = later(NGRAM, guess)
    else:
        drafted = later(SpeculativeConfig("draft", num_tokens=2))
    for i in (1, 2):
        pair = (torch.bincount(t[:, i], minlength=128) for t in (plain, drafted))
        assert _homogeneous(*pair) > 1e-3


def test_bad_settings_are_refused_naming_the_flag(folder, tmp_path):
    model = load_model(folder)
    for bad, flag in (
        (replace(NGRAM, num_tokens=0), "--num-speculative-tokens"),
        (replace(NGRAM, num_tokens=33), "--num-speculative-tokens"),
        (replace(NGRAM, prompt_lookup_min=3, prompt_lookup_max=2), "--prompt-lookup-max"),
        (replace(NGRAM, prompt_lookup_min=0), "--prompt-lookup-min"),
        (SpeculativeConfig("draft"), "--draft"),
    ):
        with pytest.raises(ConfigError, match=flag):
            Engine(model, config=EngineConfig(num_blocks=16, speculative=bad))
    with pytest.raises(ConfigError, match="--num-speculative-tokens"):
        Engine(model, config=EngineConfig(num_blocks=16, max_step_tokens=4, speculative=NGRAM))

    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    same_vocabulary(Tok({"a": 0, "b": 1}), Tok({"b": 1, "a": 0}), "d")
    with pytest.raises(ConfigError, match="--draft d"):
        same_vocabulary(Tok({"a": 0, "b": 1}), Tok({"a": 1, "b": 0}), "d")


def test_acceptance_counters_reach_metrics(folder):
    from prometheus_client import generate_latest

    from shardforge.infer.metrics import Metrics

    engine = Engine(load_model(folder), config=EngineConfig(block_size=4, num_blocks=128, speculative=NGRAM))
    engine.generate(_prompts_with_repeats(), GREEDY)
    stats = engine.stats()

    class Runner:
        waiting = 0

    Runner.stats = stats
    text = generate_latest(Metrics(Runner()).registry).decode()
    assert f"shardforge_spec_decode_num_draft_tokens {float(stats.spec_draft_tokens)}" in text
    assert f"shardforge_spec_decode_num_accepted_tokens {float(stats.spec_accepted_tokens)}" in text
    rate = stats.spec_accepted_tokens / stats.spec_draft_tokens
    assert f"shardforge_spec_decode_acceptance_rate {rate}" in text


def test_stop_strings_and_structured_outputs_fall_back_to_plain_decoding(folder):
    """Served as without speculation (documented in engine.py's `_speculates`): no draft is made for them."""
    engine = Engine(load_model(folder), config=EngineConfig(block_size=4, num_blocks=128, speculative=NGRAM))
    plain = Engine(load_model(folder), config=EngineConfig(block_size=4, num_blocks=128))
    params = replace(GREEDY, stop=("never appears",))
    assert _tokens(engine, _prompts_with_repeats(), params) == _tokens(plain, _prompts_with_repeats(), params)
    assert engine.stats().spec_drafts == 0
