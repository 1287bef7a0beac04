"""Speculative decoding side by side: shardforge's engine with no speculation, with prompt lookup (n-gram) and
with a draft model, against transformers' `generate` with no speculation, with `prompt_lookup_num_tokens=`
and with assisted generation (`assistant_model=`), on the same chat prompts, greedy, one request at a time
(assisted generation in transformers takes one sequence), in the same precision. Reported per variant:
output tokens/s, the speed-up over its own library's plain decoding, the acceptance rate (shardforge's
EngineStats: draft tokens kept / checked), and whether its tokens equal plain decoding's.

Half of the prompts ask to copy a passage with a small edit (where the output repeats the input: prompt
lookup's case), half ask a question. The draft model is `--draft DIR`, or with `--draft-layers N` the
target's first N layers (and its norm and head) saved as a model of their own: a draft of the same tokenizer
where no smaller sibling is at hand (SmolLM2-135M has none here).

    python benchmarks/speculative.py --model ../models/smollm2-135m --draft-layers 8 --new-tokens 96
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PASSAGES = [
    "The quick brown fox jumps over the lazy dog near the river bank every morning before the sun rises.",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b",  # noqa: E501
    "Paris is the capital of France. It is known for the Eiffel Tower, the Louvre museum and its cafes.",
    "To bake bread, mix flour, water, salt and yeast, knead the dough, let it rise, "
    "then bake it for an hour.",
]
QUESTIONS = [
    "What is the capital of France? Answer in two sentences.",
    "Explain what a neural network is to a child.",
    "List three facts about the moon.",
    "Write a short poem about the sea.",
]


def chat_prompts(folder: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    asks = [f"Copy this text exactly, then write it once more in capital letters:\n\n{p}" for p in PASSAGES]
    out = []
    for ask in asks + QUESTIONS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": ask}], tokenize=False, add_generation_prompt=True
        )
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def truncated_draft(folder: Path, layers: int, out: Path) -> Path:
    """The target's first `layers` layers, its final norm and head, saved as a model folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder).save_pretrained(out)
    return out


def engines(folder: Path, variants: list, dtype: str) -> list:
    """(name, engine) per variant (name, SpeculativeConfig or None, draft folder or None), warmed up."""
    from shardforge.infer.engine import Engine
    from shardforge.infer.engine_types import EngineConfig
    from shardforge.infer.load import load_for_inference
    from shardforge.infer.packed import inference_layout

    loaded = load_for_inference(folder, dtype=dtype)
    inference_layout(loaded.model)
    out = []
    for name, spec, draft_folder in variants:
        draft = None
        if draft_folder is not None:
            draft = load_for_inference(draft_folder, dtype=dtype).model
            inference_layout(draft)
        config = EngineConfig(speculative=spec, kv_memory_bytes=1 << 28)
        out.append((name, Engine(loaded.model, loaded.tokenizer, config, loaded.defaults, draft=draft)))
    return out


def generators(folder: Path, variants: list, dtype: str) -> list:
    """(name, transformers model, generate keywords) per variant (name, keywords; an assistant folder as
    `assistant_model` is loaded)."""
    import torch
    from transformers import AutoModelForCausalLM

    def load(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()

    model = load(folder)
    model.generation_config.eos_token_id = None
    out = []
    for name, kwargs in variants:
        if "assistant_model" in kwargs:
            kwargs = {**kwargs, "assistant_model": load(kwargs["assistant_model"])}
        out.append((name, model, kwargs))
    return out


def timed(variants: list, prompts: list, one) -> list[dict]:
    """Every variant on every prompt, the variants back to back per prompt (this machine's speed drifts
    over minutes: each ratio then compares runs of the same moment); one warm-up each first."""
    for variant in variants:
        one(variant, prompts[0])
    walls = [0.0] * len(variants)
    outputs: list[list] = [[] for _ in variants]
    for prompt in prompts:
        for i, variant in enumerate(variants):
            start = time.perf_counter()
            outputs[i].append(one(variant, prompt))
            walls[i] += time.perf_counter() - start
        print("  " + ", ".join(f"{v[0]} {w:.1f} s" for v, w in zip(variants, walls, strict=True)),
              file=sys.stderr, flush=True)  # fmt: skip
    return [{"variant": v[0], "wall_s": w, "tokens": sum(map(len, o)), "outputs": o}
            for v, w, o in zip(variants, walls, outputs, strict=True)]  # fmt: skip


def run_engines(folder: Path, prompts: list, new: int, variants: list, dtype: str) -> list[dict]:
    from shardforge.infer.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    built = engines(folder, variants, dtype)
    runs = timed(built, prompts, lambda v, p: v[1].generate([p], params)[0][0].tokens)
    for run, (_, engine) in zip(runs, built, strict=True):
        stats = engine.stats()
        drafted = stats.spec_draft_tokens
        run["acceptance"] = stats.spec_accepted_tokens / drafted if drafted else None
    return runs


def run_generators(folder: Path, prompts: list, new: int, variants: list, dtype: str) -> list[dict]:
    import torch

    def one(variant, prompt: list[int]) -> list[int]:
        _, model, kwargs = variant
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                                 attention_mask=torch.ones_like(ids), **kwargs)  # fmt: skip
        return out[0, len(prompt) :].tolist()

    runs = timed(generators(folder, variants, dtype), prompts, one)
    for run in runs:
        run["acceptance"] = None
    return runs


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--model", required=True, help="the target: an HF model folder")
    parser.add_argument("--draft", default=None, help="a draft model folder of the same tokenizer")
    parser.add_argument("--draft-layers", type=int, default=None, help="else the target's first N layers")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=1)
    parser.add_argument("--prompt-lookup-max", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip", nargs="*", default=[], help="variants to leave out: hf, engine")
    parser.add_argument("--prompts", type=int, default=8, help="how many of the 8 prompts (half copy a text)")
    parser.add_argument("--out", default=None, help="write the JSON results here")
    args = parser.parse_args()

    import torch

    from shardforge.infer.speculative import SpeculativeConfig

    torch.set_num_threads(args.threads)
    folder = Path(args.model)
    prompts = chat_prompts(folder)
    prompts = prompts[: args.prompts // 2] + prompts[4 : 4 + args.prompts - args.prompts // 2]
    k = args.num_speculative_tokens
    draft = Path(args.draft) if args.draft else None
    if draft is None and args.draft_layers:
        draft = truncated_draft(folder, args.draft_layers, Path(tempfile.mkdtemp()) / "draft")
    ngram = SpeculativeConfig("ngram", k, args.prompt_lookup_min, args.prompt_lookup_max)
    runs = []
    if "engine" not in args.skip:
        variants = [("shardforge", None, None), ("shardforge ngram", ngram, None)]
        if draft is not None:
            variants.append(("shardforge draft", SpeculativeConfig("draft", k), draft))
        runs += run_engines(folder, prompts, args.new_tokens, variants, args.dtype)
    if "hf" not in args.skip:
        lookup = {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": args.prompt_lookup_max}
        hf = [("transformers", {}), ("transformers prompt lookup", lookup)]
        if draft is not None:
            hf.append(("transformers assisted", {"assistant_model": str(draft)}))
        runs += run_generators(folder, prompts, args.new_tokens, hf, args.dtype)
    base = {"shardforge": None, "transformers": None}
    print(f"{len(prompts)} prompts, {args.new_tokens} new tokens each, greedy, one at a time, {args.dtype}, "
          f"k={k}, n-gram {args.prompt_lookup_min}..{args.prompt_lookup_max}, draft {draft}")  # fmt: skip
    print(f"{'variant':<30} {'tokens/s':>9} {'speed-up':>9} {'accepted':>9} {'= plain':>8}")
    for run in runs:
        family = run["variant"].split()[0]
        if base[family] is None:
            base[family] = run
        plain = base[family]
        run["tokens_per_s"] = run["tokens"] / run["wall_s"]
        run["speedup"] = run["tokens_per_s"] / plain["tokens_per_s"]
        run["equal_to_plain"] = sum(
            a == b for a, b in zip(run["outputs"], plain["outputs"], strict=True)
        ) / len(prompts)
        rate = "-" if run["acceptance"] is None else f"{run['acceptance']:.1%}"
        print(f"{run['variant']:<30} {run['tokens_per_s']:>9.1f} {run['speedup']:>8.2f}x {rate:>9} "
              f"{run['equal_to_plain']:>8.0%}", flush=True)  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps([{k: v for k, v in r.items() if k != "outputs"} for r in runs]))


if __name__ == "__main__":
    main()
