"""Weight-only int8 / int4 against fp32 and bf16 on the same requests, with transformers' equivalent beside
them: decode tokens/s (one stream, and a batch of concurrent ones), the weights' memory and the process's
peak, perplexity on held-out text, and greedy agreement with the fp32 model.

Every variant runs in a process of its own (its peak memory is its own):
- shardforge's engine as `generate` builds it (`--quantize int8|int4 --group-size N`, `--dtype`);
- transformers' `generate` on the same model, fp32, and with `TorchAoConfig(Int8WeightOnlyConfig())`
  (torchao's int8, the transformers user's route) and, where its shapes allow, torchao's CPU int4.

    python benchmarks/quantized.py --model /work/models/smollm2-135m --out benchmarks/results_quantized.json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HELD_OUT = REPO / "docs" / "DESIGN.md"  # not what SmolLM2 was trained on; the same text for every variant
VARIANTS = {
    "sf-fp32": ("shardforge", "float32", None, 0),
    "sf-bf16": ("shardforge", "bfloat16", None, 0),
    "sf-int8": ("shardforge", "float32", "int8", 0),
    "sf-int4-g64": ("shardforge", "float32", "int4", 64),
    "sf-int4-g32": ("shardforge", "float32", "int4", 32),
    "hf-fp32": ("transformers", "float32", None, 0),
    "hf-bf16": ("transformers", "bfloat16", None, 0),
    "hf-torchao-int8": ("transformers", "float32", "int8", 0),
    "hf-torchao-int4-g64": ("transformers", "bfloat16", "int4", 64),
}


def prompts(tokenizer, n: int) -> list[list[int]]:
    questions = [
        "What is the capital of France?", "Write a short poem about the sea.", "Explain what a CPU does.",
        "Give three tips for learning a language.", "What is photosynthesis?", "Describe a cat in one line.",
        "How do airplanes fly?", "Name the planets of the solar system.",
    ]  # fmt: skip
    chats = [[{"role": "user", "content": questions[i % len(questions)]}] for i in range(n)]
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def held_out(tokenizer, tokens: int) -> list[int]:
    return tokenizer(HELD_OUT.read_text())["input_ids"][:tokens]


def perplexity(forward, ids: list[int], window: int) -> float:
    import torch

    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[start : start + window + 1]])
            logits = forward(chunk[:, :-1]).float()
            loss = torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum")
            nll, count = nll + loss.item(), count + chunk.shape[1] - 1
    return float(torch.exp(torch.tensor(nll / count)))


def weight_bytes(model) -> int:
    """The bytes the weights hold (a tied head once; a torchao tensor's inner tensors)."""
    seen, total = set(), 0
    stack = list(model.parameters()) + list(model.buffers())
    while stack:
        t = stack.pop()
        if hasattr(t, "tensor_data_names"):  # a torchao tensor subclass
            stack += [getattr(t, n) for n in t.tensor_data_names if getattr(t, n, None) is not None]
            continue
        if id(t) in seen or t.device.type == "meta":
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def run_shardforge(folder: Path, dtype: str, scheme: str | None, group: int, args) -> dict:
    from shardforge.infer.engine import Engine
    from shardforge.infer.engine_types import EngineConfig
    from shardforge.infer.load import load_for_inference
    from shardforge.infer.packed import inference_layout
    from shardforge.infer.quantized import Quantization
    from shardforge.infer.sampling import SamplingParams

    quantize = Quantization(scheme, group or 128) if scheme else None
    loaded = load_for_inference(folder, dtype=dtype, quantize=quantize)
    model = loaded.model
    ppl = perplexity(lambda x: model(x), held_out(loaded.tokenizer, args.ppl_tokens), args.window)
    nbytes = weight_bytes(model)
    inference_layout(model)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    asks = prompts(loaded.tokenizer, args.batch)
    out: dict = {"perplexity": ppl, "weight_bytes": nbytes}
    Engine(model, loaded.tokenizer, EngineConfig(), loaded.defaults).generate(asks[:1], [greedy])  # warm
    for label, batch in (("one", asks[:1]), ("batch", asks)):
        engine = Engine(model, loaded.tokenizer, EngineConfig(max_running=len(batch)), loaded.defaults)
        start = time.perf_counter()
        done = engine.generate(batch, [greedy] * len(batch))
        wall = time.perf_counter() - start
        out[f"{label}_tokens_per_s"] = sum(len(c[0].tokens) for c in done) / wall
        out[f"{label}_outputs"] = [c[0].tokens for c in done]
    return out


def run_transformers(folder: Path, dtype: str, scheme: str | None, group: int, args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TorchAoConfig

    tokenizer = AutoTokenizer.from_pretrained(folder)
    kwargs: dict = {"dtype": getattr(torch, dtype)}
    if scheme == "int8":
        from torchao.quantization import Int8WeightOnlyConfig

        kwargs["quantization_config"] = TorchAoConfig(Int8WeightOnlyConfig())
    elif scheme == "int4":
        from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig

        kwargs["quantization_config"] = TorchAoConfig(PrototypeInt4WeightOnlyConfig(group_size=group))
    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()
    ppl = perplexity(lambda x: model(x).logits, held_out(tokenizer, args.ppl_tokens), args.window)
    out: dict = {"perplexity": ppl, "weight_bytes": weight_bytes(model)}
    asks = prompts(tokenizer, args.batch)
    with torch.no_grad():
        model.generate(torch.tensor([asks[0]]), max_new_tokens=4, do_sample=False)  # warm
        start = time.perf_counter()
        gen = model.generate(torch.tensor([asks[0]]), max_new_tokens=args.new_tokens, do_sample=False,
                             min_new_tokens=args.new_tokens)  # fmt: skip
        wall = time.perf_counter() - start
    out["one_tokens_per_s"] = args.new_tokens / wall
    out["one_outputs"] = [gen[0, len(asks[0]) :].tolist()]
    return out


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> float:
    """Greedy tokens equal to the reference's, position by position (a divergence counts all that follow)."""
    same = total = 0
    for out, ref in zip(outputs, reference, strict=True):
        total += len(ref)
        for a, b in zip(out, ref, strict=False):
            if a != b:
                break
            same += 1
    return same / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--batch", type=int, default=16, help="concurrent requests of the batch column")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--ppl-tokens", type=int, default=2048)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a variant, in this process
    args = parser.parse_args()
    if args.one:
        import torch

        torch.set_num_threads(args.threads)
        side, dtype, scheme, group = VARIANTS[args.one]
        run = run_shardforge if side == "shardforge" else run_transformers
        result = run(Path(args.model), dtype, scheme, group, args)
        result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print("RESULT " + json.dumps(result))
        return
    results: dict = {}
    for name in args.variants:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--one", name]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        if not line:
            print(f"{name}: failed\n{done.stderr[-2000:]}", flush=True)
            continue
        results[name] = json.loads(line[0][len("RESULT ") :])
        show(name, results)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


def show(name: str, results: dict) -> None:
    r = results[name]
    ref = results.get("sf-fp32" if name.startswith("sf-") else "hf-fp32")
    agree = ""
    if ref is not None:
        agree = f"  greedy agreement (1 stream) {agreement(r['one_outputs'], ref['one_outputs']):.3f}"
        if "batch_outputs" in r:
            agree += f", batch {agreement(r['batch_outputs'], ref['batch_outputs']):.3f}"
    batch = f", batch {r['batch_tokens_per_s']:.1f}" if "batch_tokens_per_s" in r else ""
    print(
        f"{name:20s} decode {r['one_tokens_per_s']:.1f} tok/s (1 stream){batch}; weights "
        f"{r['weight_bytes'] / 2**20:.0f} MiB, peak RSS {r['peak_rss_mb']:.0f} MiB; perplexity "
        f"{r['perplexity']:.3f}{agree}",
        flush=True,
    )


if __name__ == "__main__":
    main()
