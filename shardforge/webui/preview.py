"""The first records of a training set as the trainer will see them: read by the same reader, rendered by
the same objective's encoder (chat template and all), with the target tokens highlighted; and the lengths
of the first few hundred (the histogram beside the preview)."""

from __future__ import annotations

import html

from shardforge.config import Config


def preview_records(config: Config, count: int = 3, measured: int = 200) -> tuple[list, list[int]]:
    """Per record of the first `count`, its first sequence as (text, is_target) runs of tokens; and the
    token lengths of the first sequences of the first `measured` records (the length histogram)."""
    from shardforge.data.loader import read_dataset
    from shardforge.models.build import load_tokenizer
    from shardforge.objectives import build_objective, reading_of

    tokenizer = load_tokenizer(config.model)
    objective = build_objective(config.method)
    encoder = objective.encoder(tokenizer, config.data)
    spec = config.data.train[0].model_copy(update={"max_samples": max(count, measured)})
    shown, lengths = [], []
    for record in read_dataset(spec, reading_of(objective, config.data.default_system)):
        ids, trained = encoder(record)[0]
        lengths.append(len(ids))
        if len(shown) == count:
            continue
        ids, trained = list(ids)[: config.data.max_length], list(trained)[: config.data.max_length]
        runs: list[tuple[list[int], bool]] = []
        for token, target in zip(ids, trained, strict=True):
            if runs and runs[-1][1] == bool(target):
                runs[-1][0].append(int(token))
            else:
                runs.append(([int(token)], bool(target)))
        shown.append([(tokenizer.decode(tokens), target) for tokens, target in runs])
    return shown, lengths


def as_html(records: list[list[tuple[str, bool]]]) -> str:
    """Each record in a box; target tokens (the ones the loss is computed on) highlighted."""
    legend = '<p>highlighted: <mark class="sf-target">target tokens</mark> (the loss is computed on them)</p>'
    boxes = []
    for i, runs in enumerate(records):
        body = "".join(
            f'<mark class="sf-target">{html.escape(text)}</mark>' if target else html.escape(text)
            for text, target in runs
        )
        boxes.append(f'<div class="sf-record"><b>record {i + 1}</b><pre>{body}</pre></div>')
    return legend + "".join(boxes)
