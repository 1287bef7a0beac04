"""Generate the tiny, deterministic demo datasets and BPE tokenizer used by the shardforge examples.

Writes ``demo_alpaca.jsonl`` (train), ``demo_sharegpt.jsonl`` (multi-turn), ``demo_eval.jsonl``
(held-out), ``demo_pref.jsonl`` (preference pairs: the right answer chosen, another question's answer
rejected), ``demo_kto.jsonl`` (single completions: the right answer labelled desirable, another question's
answer undesirable), ``demo_math.jsonl`` (multiplication prompts with their answers, for the RL examples),
``demo_tools.jsonl`` (tool use in LLaMA-Factory's glaive_toolcall form, with a tools column)
and a transformers-loadable byte-level BPE ``tokenizer/`` with a ChatML chat template.
Tasks are small arithmetic/string puzzles a tiny model can learn in minutes on CPU.
Run: ``python examples/data/make_demo_data.py [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

_WORD_TEXT = """
apple river garden window yellow orange purple silver planet rocket forest island mountain valley
ocean summer winter spring autumn morning evening bright simple happy quiet gentle strong little
market village castle bridge candle pencil paper letter number circle square button pocket jacket
basket bottle kitten puppy rabbit turtle monkey tiger zebra camel horse sheep goat chicken eagle
falcon parrot spider beetle dragon wizard knight prince queen farmer doctor teacher sailor painter
baker singer dancer writer reader player driver helper friend sister brother mother father family
people person child school office kitchen bedroom garage library museum theater hospital station
airport harbor street corner center circus concert picnic holiday weekend monday friday today
tomorrow minute second hour moment winner answer question problem method system pattern signal
engine motor wheel handle ladder hammer needle thread cotton velvet marble copper iron stone
crystal diamond pearl ruby emerald amber coral cloud storm thunder rain snow frost breeze shadow
sunset sunrise meadow desert canyon glacier volcano jungle prairie lagoon harvest pepper butter
cheese bread honey sugar salt lemon cherry grape melon peach plum banana mango carrot potato
tomato onion garlic ginger cookie muffin waffle noodle pizza salad soup coffee water juice milk
table chair sofa lamp mirror carpet curtain pillow blanket clock phone laptop camera radio
guitar piano violin drum flute trumpet song music rhythm melody poem story novel chapter page
word sentence language travel journey voyage ticket passport map compass anchor sail boat ship
train truck bicycle wagon garden flower tulip daisy rose lily maple willow cedar pine oak fern
moss grass leaf branch root seed blossom orchard field farm barn fence gate path road trail
hill lake pond creek stream shore beach wave tide sand shell pebble rock cave cliff peak
green blue red black white brown pink gray golden silent rapid calm brave clever kind proud
eager fancy jolly lucky merry neat polite shiny smooth tiny giant swift warm cold fresh sweet
"""
WORDS = list(dict.fromkeys(_WORD_TEXT.split()))  # dedupe, keep order
SYSTEM = "You are a helpful assistant."
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
Example = tuple[str, str, str]  # (instruction, input, output)


def t_add(r: random.Random) -> Example:
    a, b = r.randint(1, 999), r.randint(1, 999)
    ins = r.choice(["Add the two numbers.", "What is the sum?", "Compute the sum of the two numbers."])
    out = r.choice([f"{a + b}", f"The sum of {a} and {b} is {a + b}.", f"{a} + {b} = {a + b}"])
    return ins, f"{a} + {b}", out


def t_sub(r: random.Random) -> Example:
    a, b = sorted((r.randint(1, 999), r.randint(1, 999)), reverse=True)
    ins = r.choice(["Subtract the second number from the first.", "What is the difference?"])
    out = r.choice([f"{a - b}", f"{a} minus {b} is {a - b}.", f"{a} - {b} = {a - b}"])
    return ins, f"{a} - {b}", out


def t_mul(r: random.Random) -> Example:
    a, b = r.randint(2, 12), r.randint(2, 12)
    ins = r.choice(["Multiply the two numbers.", "What is the product?", "Calculate the product."])
    out = r.choice([f"{a * b}", f"{a} times {b} is {a * b}.", f"The product of {a} and {b} is {a * b}."])
    return ins, f"{a} x {b}", out


def t_reverse(r: random.Random) -> Example:
    w = r.choice(WORDS)
    ins = r.choice(["Reverse the word.", "Write the word backwards.", "Spell the word in reverse order."])
    out = r.choice([w[::-1], f"The word {w} reversed is {w[::-1]}."])
    return ins, w, out


def t_upper(r: random.Random) -> Example:
    text = " ".join(r.choices(WORDS, k=r.randint(1, 8)))
    ins = r.choice(
        ["Uppercase the text.", "Convert the text to capital letters.", "Write this in upper case."]
    )
    return ins, text, text.upper()


def t_count(r: random.Random) -> Example:
    w = r.choice(WORDS)
    ins = r.choice(["Count the letters in the word.", "How many letters are in the word?"])
    out = r.choice([str(len(w)), f"The word {w} has {len(w)} letters."])
    return ins, w, out


def t_sort(r: random.Random) -> Example:
    w = r.choice(WORDS)
    ins = r.choice(
        ["Sort the letters alphabetically.", "Arrange the letters of the word in alphabetical order."]
    )
    return ins, w, "".join(sorted(w))


def t_sequence(r: random.Random) -> Example:
    start, step, n = r.randint(0, 50), r.randint(1, 12), r.randint(3, 7)
    seq = [start + i * step for i in range(n + 1)]
    ins = r.choice(
        ["What is the next number in the sequence?", "Continue the sequence with one more number."]
    )
    nxt = seq[-1]
    out = r.choice([str(nxt), f"The sequence adds {step} each time, so the next number is {nxt}."])
    return ins, ", ".join(map(str, seq[:-1])), out


def t_repeat(r: random.Random) -> Example:
    w = r.choice(WORDS)
    ins = r.choice(["Repeat the word three times.", "Say the word three times, separated by spaces."])
    return ins, w, " ".join([w] * 3)


def t_parity(r: random.Random) -> Example:
    n = r.randint(0, 9999)
    p = "even" if n % 2 == 0 else "odd"
    ins = r.choice(["Is the number even or odd?", "Tell me whether the number is even or odd."])
    return ins, str(n), r.choice([p, f"{n} is an {p} number." if p == "odd" else f"{n} is an even number."])


TASKS: list[Callable[[random.Random], Example]] = [
    t_add, t_sub, t_mul, t_reverse, t_upper, t_count, t_sort, t_sequence, t_repeat, t_parity,
]  # fmt: skip


def make_alpaca(r: random.Random, n: int, exclude: set[tuple[str, str]] | None = None) -> list[dict]:
    rows: list[dict] = []
    while len(rows) < n:
        ins, inp, out = r.choice(TASKS)(r)
        if exclude is not None and (ins, inp) in exclude:
            continue
        rows.append({"instruction": ins, "input": inp, "output": out})
    return rows


def make_math(r: random.Random, n: int) -> list[dict]:
    """RL prompts: the demo's multiplication-table task (the one the demo model half knows after its SFT),
    each with its bare answer (the `answer` column)."""
    rows = []
    for _ in range(n):
        ins, inp, _ = t_mul(r)
        a, _, b = inp.split()
        rows.append({"instruction": ins, "input": inp, "answer": str(int(a) * int(b))})
    return rows


def make_sharegpt(r: random.Random, n: int) -> list[dict]:
    rows: list[dict] = []
    for _ in range(n):
        conv = [{"from": "system", "value": SYSTEM}] if r.random() < 0.3 else []
        for _ in range(r.choice([1, 1, 2])):
            ins, inp, out = r.choice(TASKS)(r)
            conv += [{"from": "human", "value": f"{ins}\n\n{inp}"}, {"from": "gpt", "value": out}]
        rows.append({"conversations": conv})
    return rows


def make_pairs(r: random.Random, n: int) -> list[dict]:
    rows: list[dict] = []
    while len(rows) < n:
        ins, inp, out = r.choice(TASKS)(r)
        wrong = r.choice(TASKS)(r)[2]
        if wrong != out:
            rows.append({"instruction": ins, "input": inp, "chosen": out, "rejected": wrong})
    return rows


def make_kto(r: random.Random, n: int) -> list[dict]:
    """KTO examples, alternately desirable and undesirable, in our {messages, completion, label} form."""
    rows: list[dict] = []
    for pair in make_pairs(r, n):
        user = f"{pair['instruction']}\n\n{pair['input']}" if pair["input"] else pair["instruction"]
        desirable = len(rows) % 2 == 0
        completion = pair["chosen"] if desirable else pair["rejected"]
        rows.append(
            {"messages": [{"role": "user", "content": user}], "completion": completion, "label": desirable}
        )
    return rows


def to_messages(row: dict) -> list[dict[str, str]]:
    user = f"{row['instruction']}\n\n{row['input']}" if row["input"] else row["instruction"]
    return [{"role": "user", "content": user}, {"role": "assistant", "content": row["output"]}]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def train_tokenizer(rows: list[dict], out_dir: Path, vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    roles = ["system\n" + SYSTEM, "user\n", "assistant\n"] * 50
    texts = roles + [f"{x['instruction']}\n\n{x['input']}\n{x['output']}\n" for x in rows]
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=32768,  # positions are the model's limit, not the tokenizer's
        padding_side="right",
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out_dir))
    return hf


def verify_tokenizer(out_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n", repr(text)
    gen = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert gen == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", repr(gen)
    ids = tok(text, add_special_tokens=True)["input_ids"]
    assert tok.decode(ids) == text, tok.decode(ids)
    for s in SPECIALS:
        assert len(tok(s, add_special_tokens=False)["input_ids"]) == 1, s
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.bos_token is None
    assert tok.is_fast and tok(text, return_offsets_mapping=True)["offset_mapping"]
    assert len(tok) == 1024, len(tok)


TOOLS = [
    {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
    {
        "name": "add",
        "description": "the sum of two numbers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
]
CITIES = ["Oslo", "Paris", "Rome", "Lima", "Cairo", "Tokyo"]
WEATHER = ["rain", "snow", "sun", "wind"]


def make_tools(rng: random.Random, n: int) -> list[dict]:
    """Tool use in LLaMA-Factory's glaive_toolcall form (function_call / observation turns, a `tools` column
    holding the functions as a JSON string): a weather lookup, a sum, and plain requests answered without a
    call. Small enough for a tiny model to learn the calls in a few hundred steps (the server's tool-call
    test)."""
    rows = []
    for _ in range(n):
        kind = rng.choice(["weather", "add", "say"])
        if kind == "weather":
            city, weather = rng.choice(CITIES), rng.choice(WEATHER)
            call = {"name": "get_weather", "arguments": {"city": city}}
            turns = [("human", f"weather in {city}?"), ("function_call", json.dumps(call))]
            turns += [("observation", json.dumps({"weather": weather})), ("gpt", f"{weather} in {city}.")]
        elif kind == "add":
            a, b = rng.randint(1, 9), rng.randint(1, 9)
            call = {"name": "add", "arguments": {"a": a, "b": b}}
            turns = [("human", f"add {a} and {b}"), ("function_call", json.dumps(call))]
            turns += [("observation", json.dumps({"sum": a + b})), ("gpt", f"{a + b}")]
        else:
            word = rng.choice(WORDS[:20])
            turns = [("human", f"say {word}"), ("gpt", word)]
        conversations = [{"from": who, "value": value} for who, value in turns]
        rows.append({"conversations": conversations, "tools": json.dumps(TOOLS)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    out: Path = ap.parse_args().out
    out.mkdir(parents=True, exist_ok=True)

    train = make_alpaca(random.Random(0), 4000)
    sharegpt = make_sharegpt(random.Random(1), 300)
    seen = {(x["instruction"], x["input"]) for x in train}
    evals = make_alpaca(random.Random(2), 200, exclude=seen)
    pairs = make_pairs(random.Random(3), 400)
    files = {"demo_alpaca.jsonl": train, "demo_sharegpt.jsonl": sharegpt, "demo_eval.jsonl": evals}
    files["demo_pref.jsonl"] = pairs
    files["demo_kto.jsonl"] = make_kto(random.Random(4), 400)
    files["demo_math.jsonl"] = make_math(random.Random(5), 400)
    files["demo_tools.jsonl"] = make_tools(random.Random(6), 300)
    for name, rows in files.items():
        write_jsonl(out / name, rows)
        print(f"wrote {out / name}: {len(rows)} records, {(out / name).stat().st_size:,} bytes")

    tok_dir = out / "tokenizer"
    tok = train_tokenizer(train, tok_dir)
    verify_tokenizer(tok_dir)
    size = sum(p.stat().st_size for p in tok_dir.iterdir())
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    print(f"wrote {tok_dir}/: vocab {len(tok)}, {size:,} bytes, special ids {ids}")
    lens = [len(tok(tok.apply_chat_template(to_messages(x), tokenize=False))["input_ids"]) for x in train]
    print(f"alpaca chat tokens/record: min {min(lens)} median {statistics.median(lens)} max {max(lens)}")


if __name__ == "__main__":
    main()
