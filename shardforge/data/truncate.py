"""LLaMA-Factory's truncation (`data.truncation: lf`): an over-long example is shortened prompt and reply
each, never dropped, as LF's processors do (`infer_seqlen`): the reply is kept whole while it takes under
half the room, else the prompt while it does, else both are cut in proportion; each part keeps its start.

- a conversation: its (prompt, reply) turns in order, each within the room the earlier ones left, the turns
  past the limit gone (LF's supervised processor);
- a preference pair: one prompt cut for both replies, against the longer reply (LF's pairwise processor);
- a KTO completion and its mismatched one: each on its own (LF's feedback processor).

An example is a token sequence and its target flags; its turns are the runs of untrained (prompt) and trained
(reply) tokens. tests/lf/ checks `infer_seqlen` against LF's own.
"""

from __future__ import annotations

import numpy as np

Sequence = tuple[np.ndarray, np.ndarray]  # (ids, target flags)


def infer_seqlen(source: int, target: int, cutoff: int) -> tuple[int, int]:
    """How many prompt and reply tokens LF keeps of `source` and `target` within `cutoff`."""
    if target * 2 < cutoff:
        most = cutoff
    elif source * 2 < cutoff:
        most = cutoff - source
    else:
        most = int(cutoff * (target / (source + target)))
    kept_target = min(most, target)
    return min(max(cutoff - kept_target, 0), source), kept_target


def _turns(trained: np.ndarray) -> list[tuple[int, int, int]]:
    """(prompt start, reply start, end) of each turn: an untrained run then the trained run after it (a
    run of either kind may be empty: a sequence that starts trained, or untrained tokens after the last
    reply)."""
    edges = np.flatnonzero(np.diff(trained.astype(np.int8))) + 1
    bounds = [0, *edges.tolist(), len(trained)]
    runs = [(bounds[i], bounds[i + 1], bool(trained[bounds[i]])) for i in range(len(bounds) - 1)]
    turns, start = [], 0
    for begin, end, is_target in runs:
        if is_target:
            turns.append((start, begin, end))
            start = end
    if start < len(trained):
        turns.append((start, len(trained), len(trained)))
    return turns


def _take(seq: Sequence, spans: list[tuple[int, int]]) -> Sequence:
    ids, trained = seq
    keep = np.concatenate([np.arange(a, b) for a, b in spans]) if spans else np.zeros(0, dtype=np.int64)
    return ids[keep], trained[keep]


def cut_turns(seq: Sequence, cutoff: int, last_first: bool = False) -> Sequence:
    """A conversation cut turn by turn within `cutoff` (LF's supervised processor); `last_first`: from the
    last turn back (LF's mask_history), so the turns kept are the last ones."""
    turns, kept, total = _turns(seq[1]), {}, 0
    for i in reversed(range(len(turns))) if last_first else range(len(turns)):
        if total >= cutoff:
            break
        prompt, reply, end = turns[i]
        kept[i] = infer_seqlen(reply - prompt, end - reply, cutoff - total)
        total += sum(kept[i])
    spans = []
    for i in sorted(kept):
        prompt, reply, _ = turns[i]
        spans += [(prompt, prompt + kept[i][0]), (reply, reply + kept[i][1])]
    return _take(seq, spans)


def last_reply_only(seq: Sequence) -> Sequence:
    """Targets on the last reply alone (LF's mask_history): earlier replies become context."""
    ids, trained = seq
    if not trained.any():
        return seq
    end = len(trained) - int(np.argmax(trained[::-1]))
    start = end - int(np.argmin(trained[:end][::-1])) if not trained[:end].all() else 0
    flags = np.zeros_like(trained)
    flags[start:end] = True
    return ids, flags


def cut_shared_prompt(group: list[Sequence], cutoff: int) -> list[Sequence]:
    """Replies after one prompt (the first trained token's position in each), the prompt cut once for the
    longest reply (LF's pairwise processor)."""
    prompt = int(np.argmax(group[0][1])) if group[0][1].any() else len(group[0][0])
    longest = max(len(ids) - prompt for ids, _ in group)
    source, target = infer_seqlen(prompt, longest, cutoff)
    return [_take(seq, [(0, source), (prompt, min(len(seq[0]), prompt + target))]) for seq in group]


def cut_each(seq: Sequence, cutoff: int) -> Sequence:
    """A prompt and its reply (LF's feedback processor: each KTO sequence on its own)."""
    prompt = int(np.argmax(seq[1])) if seq[1].any() else len(seq[0])
    source, target = infer_seqlen(prompt, len(seq[0]) - prompt, cutoff)
    return _take(seq, [(0, source), (prompt, prompt + target)])


def pretraining_blocks(stream: np.ndarray, block: int, head: int | None) -> list[np.ndarray]:
    """LLaMA-Factory's pretraining packing (`data.pt_blocks`): the documents (each its tokens and EOS),
    concatenated in order as `stream`, cut into blocks of `block` tokens, the remainder (under one block)
    dropped; `head`: the BOS id that starts every block (LF does so where the tokenizer adds a BOS)."""
    count = len(stream) // block
    blocks = [stream[i * block : (i + 1) * block].copy() for i in range(count)]
    if head is not None:
        for b in blocks:
            b[0] = head
    return blocks
