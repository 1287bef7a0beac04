"""lm-evaluation-harness driving our model: `ShardforgeLM`, an `lm_eval` model (registered as `shardforge`)
whose log-likelihoods come from one batched forward of our model and whose generations come from our
inference engine, so a benchmark scores the model we train and serve, not a transformers copy of it.

Its tokenization and windowing follow lm-eval's own `hf` model (HFLM) step for step: the context and
continuation split of `TemplateLM`, the prefix token for an empty context (BOS, else EOS), left truncation
to the model's context, rolling windows for `loglikelihood_rolling`, the context cut to leave
`max_gen_toks` for generation; so the same task gives the same numbers as `--model hf` on the same weights
(tests/unit/test_eval_harness.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F

from shardforge.errors import ConfigError, ShardforgeError
from shardforge.extras import MissingExtra, install_hint
from shardforge.infer.engine import Engine
from shardforge.infer.engine_types import EngineConfig
from shardforge.infer.sampling import SamplingParams
from shardforge.log import get_logger
from shardforge.models.common.protocol import CausalModel

try:
    from lm_eval import utils as lm_utils
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError:  # the optional `eval` extra
    raise MissingExtra(f"lm-evaluation-harness is not installed: {install_hint('eval')}") from None

log = get_logger(__name__)

TASKS_DIR = Path(__file__).resolve().parent / "tasks"  # the bundled tasks (shardforge_tiny_mc, ...)
DEFAULT_BATCH = 16

Request = tuple[tuple[str | None, str], list[int], list[int]]  # (texts, context ids, continuation ids)


@register_model("shardforge")
class ShardforgeLM(TemplateLM):
    """Our model for lm-eval. Built from a model folder (`pretrained`, as `--model_args` names it; an
    adapter folder, a run folder or a checkpoint too, as `shardforge chat` takes them), or from an engine
    the caller already has (`engine`: `shardforge eval` loads the model once for both)."""

    def __init__(
        self,
        pretrained: str | None = None,
        adapter: str | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        batch_size: int | str | None = DEFAULT_BATCH,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        engine: Engine | None = None,
        **_ignored: Any,  # lm-eval's other settings (max_batch_size, ...) that do not apply here
    ) -> None:
        super().__init__()
        if engine is None:
            if pretrained is None:
                raise ConfigError("the shardforge lm-eval model needs pretrained=MODEL_FOLDER")
            from shardforge.infer.load import load_for_inference
            from shardforge.infer.packed import inference_layout

            loaded = load_for_inference(pretrained, adapter, dtype, device)
            inference_layout(loaded.model)
            model = cast(CausalModel, loaded.model)
            engine = Engine(model, loaded.tokenizer, EngineConfig(), loaded.defaults)
        self.engine = engine
        self.model = engine.model
        self.tokenizer = engine.tokenizer
        self._device = next(self.model.parameters()).device
        # lm-eval's "auto" (and None): the default; a forward's rows cost little next to a GPU's search
        self.batch_size = int(str(batch_size)) if str(batch_size).isdigit() else DEFAULT_BATCH
        self._max_length = int(max_length) if max_length else self.model.config.max_position
        self.max_gen_toks = int(max_gen_toks)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is scored after: BOS, else EOS (HFLM's choice)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "shardforge")).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """The tokenizer's own special tokens unless told otherwise, none when the text already starts with
        the prefix token (as HFLM encodes)."""
        options = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and string.startswith(self.tokenizer.decode(self.prefix_token_id)):
            options["add_special_tokens"] = False
        return self.tokenizer.encode(string, **options)

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _loglikelihood_tokens(self, requests: list[Request], disable_tqdm: bool = False, **_: Any) -> list:
        """(sum of the continuation's log-probs, whether greedy decoding would produce it) per request, from
        batched forwards (longest first) whose LM head runs only at the continuation's positions."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        started, done = time.perf_counter(), 0
        for at in range(0, len(order), self.batch_size):
            chunk = order[at : at + self.batch_size]
            for i, answer in zip(chunk, self._score([requests[i] for i in chunk]), strict=True):
                results[i] = answer
                texts = requests[i][0]
                if texts[0] is not None:  # a rolling window's pieces are not cached one by one
                    self.cache_hook.add_partial("loglikelihood", texts, answer)
            done += len(chunk)
            if not disable_tqdm and time.perf_counter() - started > 10:
                log.info(f"log-likelihoods: {done}/{len(requests)}")
                started = time.perf_counter()
        return results

    @torch.inference_mode()
    def _score(self, batch: Sequence[Request]) -> list[tuple[float, bool]]:
        """One forward over the batch's rows (right-padded: causal attention keeps the padding out of every
        real position) with the head at the continuation's positions only."""
        rows, spans = [], []
        for _, context, continuation in batch:
            if not context or not continuation or len(continuation) > self.max_length:
                raise ShardforgeError(
                    f"lm-eval request of {len(context)} context and {len(continuation)} continuation tokens:"
                    f" both must be non-empty, the continuation at most {self.max_length}"
                )
            row = (context + continuation)[-(self.max_length + 1) :][:-1]  # left-truncated, as HFLM
            rows.append(row)
            spans.append((len(row) - len(continuation), len(row)))
        width = max(len(r) for r in rows)
        x = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, (row, (start, end)) in enumerate(zip(rows, spans, strict=True)):
            x[i, : len(row)] = torch.tensor(row)
            mask[i, start:end] = True
        logits = self.model(x.to(self._device), output_mask=mask.to(self._device))  # [scored, vocab]
        logprobs = F.log_softmax(logits.float(), dim=-1).cpu()
        out, at = [], 0
        for (_, _, continuation), (start, end) in zip(batch, spans, strict=True):
            piece = logprobs[at : at + end - start]
            at += end - start
            target = torch.tensor(continuation)
            greedy = bool((piece.argmax(dim=-1) == target).all())
            out.append((float(piece.gather(1, target[:, None]).sum()), greedy))
        return out

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """A whole text's log-likelihood over disjoint windows of the model's context (lm-eval's rolling
        windows, each token predicted once, after the prefix token)."""
        windows: list[Request] = []
        owners: list[int] = []
        for n, (string,) in enumerate(req.args for req in requests):
            for context, continuation in map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append(((None, ""), context, continuation))
                owners.append(n)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for n, (logprob, _) in zip(owners, scores, strict=True):
            totals[n] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Every request through the engine at once (continuous batching): greedy unless the task samples,
        stopped at the task's `until` strings or EOS, at most `max_gen_toks` new tokens, the context cut
        from the left to leave them room (as HFLM)."""
        prompts, params = [], []
        for context, kwargs in (req.args for req in requests):
            prompts.append(context)
            params.append(self._sampling(dict(kwargs or {})))
        ids = []
        for n, (context, p) in enumerate(zip(prompts, params, strict=True)):
            keep = max(1, self.max_length - (p.max_tokens or self.max_gen_toks))
            ids.append(self.tok_encode(context)[-keep:])
            params[n] = replace(
                p, max_tokens=min(p.max_tokens or self.max_gen_toks, self.max_length - len(ids[-1]))
            )
        last = [time.perf_counter()]

        def progress(done: int, total: int) -> None:
            if not disable_tqdm and time.perf_counter() - last[0] > 10:
                log.info(f"generations: {done}/{total}")
                last[0] = time.perf_counter()

        completions = self.engine.generate(ids, params, progress)
        texts = []
        for req, done, p in zip(requests, completions, params, strict=True):
            text = done[0].text
            for stop in p.stop:  # the engine stops at the first; a later-listed one may come earlier
                text = text.split(stop)[0]
            texts.append(text)
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts

    def _sampling(self, kwargs: dict) -> SamplingParams:
        """A task's generation_kwargs as the engine's sampling parameters."""
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        eos = self.tokenizer.decode(self.eot_token_id)
        if eos and eos not in until:
            until.append(eos)
        max_tokens = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
        sample = bool(kwargs.pop("do_sample", False))
        temperature = float(kwargs.pop("temperature", 1.0 if sample else 0.0))
        if not sample or temperature == 0.0:
            temperature = 0.0
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=kwargs.pop("top_p", None) if sample else None,
            top_k=kwargs.pop("top_k", None) if sample else None,
            stop=tuple(s for s in until if s),
        ).check()


def bundled_tasks() -> list[str]:
    """The task names shipped in TASKS_DIR."""
    import yaml

    names = []
    for path in sorted(TASKS_DIR.glob("*.yaml")):
        raw = path.read_text(encoding="utf-8").replace("!function", "")  # a plain YAML read, for the name
        names.append(yaml.safe_load(raw)["task"])
    return names


def task_manager(tasks: Sequence[str], include_path: str | Path | None = None) -> Any:
    """lm-eval's TaskManager over its own tasks, the bundled ones and those under `include_path`, after
    checking that every name in `tasks` is one of them (an unknown one is refused with the near ones)."""
    from lm_eval.tasks import TaskManager

    if include_path is not None and not Path(include_path).is_dir():
        raise ConfigError(f"--include-path {include_path}: no such folder")
    paths = [str(TASKS_DIR)] + ([str(include_path)] if include_path is not None else [])
    manager = TaskManager(include_path=paths, include_defaults=False)  # indexing lm-eval's own takes seconds
    if all(t in manager.all_tasks for t in tasks):
        return manager
    manager = TaskManager(include_path=paths)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        import difflib

        near = difflib.get_close_matches(unknown[0], manager.all_tasks, n=5, cutoff=0.6)
        broken = _unreadable_yamls(Path(include_path)) if include_path is not None else []
        raise ConfigError(
            f"unknown lm-eval task {unknown[0]!r}; bundled: {', '.join(bundled_tasks())}"
            + (f"; near it: {', '.join(near)}" if near else "")
            + " (or lm-eval's own tasks by name, or a folder of task YAMLs with --include-path)"
            + (f"; these task YAMLs do not parse: {'; '.join(broken)}" if broken else "")
        )
    return manager


def _unreadable_yamls(folder: Path) -> list[str]:
    """The YAMLs under `folder` that do not parse (lm-eval skips them with a log line): each file and why.
    lm-eval's own tags (`!function`) are read as anything."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    broken = []
    for path in sorted(folder.rglob("*.yaml")):
        try:
            yaml.load(path.read_text(encoding="utf-8", errors="replace"), Loader=Loader)
        except yaml.YAMLError as exc:
            broken.append(f"{path}: {' '.join(str(exc).split())}")
    return broken


def check_tasks(tasks: Sequence[str], manager: Any) -> None:
    """Build the tasks once before a model loads: a task whose YAML holds a wrong value (an output_type
    lm-eval has not, a missing field) is a ConfigError naming it, not lm-eval's traceback mid-run."""
    from lm_eval.tasks import get_task_dict

    try:
        get_task_dict(list(tasks), manager)
    except (ValueError, KeyError, TypeError, AttributeError, FileNotFoundError) as exc:
        raise ConfigError(f"lm-eval cannot build the task(s) {', '.join(tasks)}: {exc}") from None


def run_tasks(
    lm: Any,
    tasks: Sequence[str],
    manager: Any = None,
    limit: int | None = None,
    num_fewshot: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """lm-eval's `simple_evaluate` of `lm` (ours, or any lm-eval model) on `tasks` (`manager`: from
    `task_manager`; None: lm-eval's and the bundled tasks). Returns lm-eval's results dict
    (`results[task][metric]`, and each item's requests and responses in `samples`)."""
    from lm_eval import simple_evaluate

    try:
        return _evaluate(simple_evaluate, lm, tasks, manager, limit, num_fewshot, seed)
    except ValueError as exc:
        if "Sample larger than population" not in str(exc):
            raise
        raise ConfigError(
            f"--num-fewshot {num_fewshot}: more examples than a task's few-shot pool holds ({exc})"
        ) from None


def _evaluate(
    simple_evaluate: Any, lm: Any, tasks: Sequence[str], manager: Any, limit: int | None,
    num_fewshot: int | None, seed: int,
) -> dict[str, Any]:  # fmt: skip
    return simple_evaluate(
        model=lm,
        tasks=list(tasks),
        task_manager=manager if manager is not None else task_manager(tasks),
        limit=limit,
        num_fewshot=num_fewshot,
        log_samples=True,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )


def summary(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each task's metrics (`acc,none`: a metric and the filter it was read through), the part to print."""
    return {
        task: {
            k: float(v)
            for k, v in metrics.items()
            if "," in k and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        for task, metrics in results["results"].items()
    }


RESULTS = "lm_eval_results.json"


def write_results(results: dict[str, Any], out: Path) -> Path:
    """lm-eval's results (metrics, versions, shots, the run's settings) as `lm_eval_results.json` in `out`,
    and each task's items (their requests, responses and scores) as `samples_TASK.jsonl` beside it."""
    out.mkdir(parents=True, exist_ok=True)
    kept = {
        k: results[k]
        for k in ("results", "groups", "versions", "n-shot", "n-samples", "config")
        if k in results
    }
    (out / RESULTS).write_text(json.dumps(kept, indent=2, default=str) + "\n", encoding="utf-8")
    for task, samples in results.get("samples", {}).items():
        with (out / f"samples_{task}.jsonl").open("w", encoding="utf-8") as f:
            for sample in samples:
                f.write(json.dumps(sample, default=str, ensure_ascii=False) + "\n")
    return out / RESULTS
