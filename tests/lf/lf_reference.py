"""Run by LLaMA-Factory's own Python (the reference environment, tests/lf/reference_env.py): each case's YAML
mapping through LF 0.9.5's argument parser, answered with the resolved value of every key the converter
reads and the learning rate transformers' scheduler gives at each step, as LF's trainer would build it.

    python lf_reference.py cases.json out.json

cases.json: {"keys": [...], "steps": N, "cases": {name: mapping}}. Each answer: {"args": {key: value}} or
{"error": "<LF's message>"}. Keys the parser cannot take on this machine are set aside first (deepspeed:
the package is not installed; the converter reads the JSON itself) and `use_cpu` is added (no GPU here)."""

import enum
import json
import sys

import torch
from llamafactory.hparams.parser import _parse_train_args
from transformers import get_scheduler


def plain(value):
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def resolve(mapping: dict, keys: list[str], steps: int) -> dict:
    args = {k: v for k, v in mapping.items() if k != "deepspeed"}
    args.setdefault("output_dir", "lf_reference_out")
    args["use_cpu"] = True
    try:
        parsed = _parse_train_args(args)
    except (ValueError, TypeError, SystemExit) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    out = {}
    for key in keys:
        for part in parsed:
            if hasattr(part, key):
                out[key] = plain(getattr(part, key))
                break
    training = parsed[2]
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=training.learning_rate)
    scheduler = get_scheduler(
        training.lr_scheduler_type, optimizer, num_warmup_steps=training.get_warmup_steps(steps),
        num_training_steps=steps, scheduler_specific_kwargs=training.lr_scheduler_kwargs or {},
    )  # fmt: skip
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return {"args": out, "lr": lrs}


def main() -> None:
    with open(sys.argv[1]) as f:
        request = json.load(f)
    answers = {name: resolve(m, request["keys"], request["steps"]) for name, m in request["cases"].items()}
    with open(sys.argv[2], "w") as f:
        json.dump(answers, f)


if __name__ == "__main__":
    main()
