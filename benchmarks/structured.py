"""What a structured output costs per token: the grammar's mask (llguidance, every constrained row of a step
together) and its application to the logits, beside the engine's decode step without one, on a real
tokenizer's vocabulary. Two measurements on the same model:

- the mask alone: `Grammars.allowed` for 1 and 16 rows mid-way through a JSON schema's answer (the rows at
  different places), its median per step;
- end to end: 16 requests answered under a JSON schema against the same 16 unconstrained, each to the same
  number of tokens (the constrained answers' lengths: the unconstrained ones ignore eos and stop there), the
  engine's time per output token.

transformers has no structured outputs of its own (outlines and others plug in as a logits processor), so
there is no side-by-side column.

    python benchmarks/structured.py --model /work/models/smollm2-135m --out benchmarks/results_structured.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "tags"],
    "additionalProperties": False,
}
QUESTIONS = [
    "Describe a person as JSON.", "Invent a character for a story.", "Who lives next door?",
    "Make up a customer record.", "Describe a sailor.", "Describe a teacher from Rome.",
    "Tell me about a painter.", "Describe a friend.",
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=80)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch

    from shardforge.infer.engine import Engine
    from shardforge.infer.engine_types import EngineConfig
    from shardforge.infer.grammar import Constraint
    from shardforge.infer.load import load_for_inference
    from shardforge.infer.offline import chat_ids
    from shardforge.infer.packed import inference_layout
    from shardforge.infer.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    loaded = load_for_inference(args.model)
    inference_layout(loaded.model)
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_running=64), loaded.defaults)
    tokenizer = loaded.tokenizer
    prompts = [
        chat_ids(tokenizer, [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
        for i in range(args.requests)
    ]
    constraint = Constraint("json", json.dumps(SCHEMA))

    # the mask alone, rows at different places in the answer
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0, constraint=constraint)
    [[answer]] = engine.generate(prompts[:1], greedy)
    masks: dict[int, float] = {}
    for rows in (1, 16):
        matchers = [engine.grammars.matcher(constraint) for _ in range(rows)]
        for i, m in enumerate(matchers):
            for token in answer.tokens[: (i * 3) % max(1, len(answer.tokens) - 1)]:
                m.accept(token)
        ends = [tuple(engine.defaults.eos_token_ids)] * rows
        times = []
        for _ in range(50):
            start = time.perf_counter()
            allowed = engine.grammars.allowed(matchers, ends)
            logits = torch.zeros(rows, allowed.shape[1]).masked_fill(~allowed, -torch.inf)
            times.append(time.perf_counter() - start)
        del logits
        masks[rows] = statistics.median(times) * 1e3

    # end to end: the same requests with and without the schema, to the same lengths
    def timed(params: list[SamplingParams]) -> tuple[float, list]:
        engine.generate(prompts[:2], params[:2])  # warm
        start = time.perf_counter()
        done = engine.generate(prompts, params)
        return time.perf_counter() - start, done

    sampled = [
        SamplingParams(max_tokens=args.max_tokens, temperature=0.7, seed=i, constraint=constraint)
        for i in range(args.requests)
    ]
    constrained_s, constrained = timed(sampled)
    lengths = [len(c[0].tokens) for c in constrained]
    plain = [
        SamplingParams(max_tokens=n, temperature=0.7, seed=i, ignore_eos=True) for i, n in enumerate(lengths)
    ]
    plain_s, _ = timed(plain)
    ratios = [constrained_s / plain_s]
    for _ in range(args.rounds - 1):  # alternated: the machine's speed drifts over minutes
        ratios.append(timed(sampled)[0] / timed(plain)[0])
    valid = 0
    for c in constrained:
        try:
            json.loads(c[0].text)
            valid += c[0].finish_reason == "stop"
        except json.JSONDecodeError:
            pass
    tokens = sum(lengths)
    result = {
        "model": args.model,
        "vocab": len(tokenizer),
        "mask_ms_per_step": {f"{rows} rows": round(ms, 3) for rows, ms in masks.items()},
        "requests": args.requests,
        "output_tokens": tokens,
        "finished_and_valid_json": f"{valid}/{args.requests}",
        "unconstrained_ms_per_token": round(plain_s / tokens * 1e3, 2),
        "constrained_ms_per_token": round(constrained_s / tokens * 1e3, 2),
        "overhead_per_token_pct_rounds": [round((r - 1) * 100, 1) for r in ratios],
        "overhead_per_token_pct_median": round((statistics.median(ratios) - 1) * 100, 1),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
