"""One prepared GPU check: install, environment, the CUDA test tier, bf16 training throughput and MFU, the HF
Trainer comparison and the inference engine against transformers' generate; one JSON and one text summary.

Run it through benchmarks/gpu_check.sh (its header says how, on a GPU machine and on the CPU). Each part runs
in a subprocess of its own with its own timeout, and one part that fails does not stop the others; the whole
check keeps to a time budget (`--budget`, 570 s by default: it fits a 10-minute slot on one H200), skipping
what the budget no longer covers. Nothing reaches the network: the Hugging Face libraries are told to stay
offline and every model is built from a config, never downloaded; the install (`--wheelhouse`) uses no index.

Parts, in order (`--device cuda` sizes; `--device cpu` runs the same scripts at tiny sizes, as a dry run):
  install      pip install "shardforge[gpucheck]" from the wheelhouse, beside the machine's torch
  environment  python, torch, CUDA, transformers and shardforge versions, the device and its datasheet peak
  cuda_tests   pytest -q tests/cuda (on the CPU with SHARDFORGE_TEST_DEVICE=cpu); exit 5 = no tests collected
  training     benchmarks/single_process.py: llama-1b (~0.98B), bf16, packed rows of 2048, 8 rows a step
  vs_hf_trainer  benchmarks/vs_hf_trainer.py: transformers' Trainer against shardforge, llama-300m, bf16
  inference    benchmarks/inference.py: the engine against transformers' generate, the 50M model, bf16

Writes OUT/summary.json, OUT/summary.txt (printed at the end) and OUT/<part>.log; exits 1 if a part failed.
This script uses the standard library only, so it runs before the install part has put anything in place.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "PIP_NO_INDEX": "1",
    "WANDB_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}

# The sizes. cuda: one H200 (also fits an 80 GB H100), the whole check within --budget. Estimate of the
# training part: 0.98e9 parameters x 6 FLOP x 16,384 tokens a step = 96 TFLOP a step (attention adds ~1%: the
# demo's documents are short); at ~40% of 989 TFLOP/s that is ~0.25 s a step, so 60 steps ~15 s after a
# start-up of ~30 s (building 1B parameters in fp32 on the CPU, then moving them). Memory: fp32 weights,
# gradients and AdamW's two moments 16 bytes x 0.98e9 = 15.6 GB, activations of 8 x 2048 tokens ~25 GB.
SIZES: dict[str, dict[str, str]] = {  # each script's options, after --device and the precision
    "cuda": {
        "training": "--preset llama-1b --seq 2048 --micro-batch 8 --steps 60 --log-every 10",
        "vs_hf_trainer": "--preset llama-300m --records 2000 --eval-records 50 --batch 16 --lr 3e-4 "
        "--repeats 1 --threads 8",
        "inference": "--size 50m --requests 64 --prompt-lengths 16 256 --new-tokens 16 128 --batch 16 64 "
        "--max-running 64 --threads 8",
    },
    "cpu": {  # the same scripts and flags, tiny: a dry run of the check itself, not a measurement
        "training": "--preset tiny-llama --seq 64 --micro-batch 2 --steps 8 --log-every 2 --threads 2",
        "vs_hf_trainer": "--preset tiny-llama --records 48 --eval-records 8 --batch 4 --repeats 1 "
        "--threads 1",
        "inference": "--size 5m --requests 4 --prompt-lengths 8 16 --new-tokens 4 8 --batch 4 "
        "--max-running 4 --threads 2",
    },
}
TIMEOUTS = {  # seconds per part (the budget may cut them shorter)
    "install": 180,
    "environment": 60,
    "cuda_tests": 180,
    "training": 180,
    "vs_hf_trainer": 240,
    "inference": 180,
}


@dataclass
class Result:
    status: str  # ok | failed | skipped | no tests
    seconds: float = 0.0
    why: str = ""  # skipped / failed / no tests: the reason
    command: list[str] = field(default_factory=list)
    figures: dict = field(default_factory=dict)
    log: str = ""
    tail: str = ""  # failed: the end of the output


# ---- running one part ------------------------------------------------------------------------------------
def run_command(
    cmd: list[str], env: dict[str, str], timeout: float, log: Path
) -> tuple[int | None, str, float]:
    """(exit code, None on timeout; the output; seconds). The part runs in a session of its own, so that on a
    timeout the whole tree it started (vs_hf_trainer's sides, the server) is stopped with it."""
    started = time.perf_counter()
    with open(log, "ab") as out:
        out.write(f"$ {' '.join(cmd)}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc: int | None = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            rc = None
            for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
    return rc, log.read_text(errors="replace"), time.perf_counter() - started


def tail(text: str, lines: int = 25, chars: int = 3000) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])[-chars:]


# ---- parsing what the scripts print ----------------------------------------------------------------------
def first_json_object(text: str) -> dict:
    """The first JSON object in the output that starts a line with "{" (single_process.py prints one,
    indented, after the trainer's log lines)."""
    decoder = json.JSONDecoder()
    for match in re.finditer(r"(?m)^\{", text):
        try:
            obj, _ = decoder.raw_decode(text, match.start())
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            return obj
    raise ValueError("no JSON object in the output")


def pytest_counts(text: str) -> dict[str, int]:
    """passed / failed / skipped / errors from pytest's last summary line ("3 passed, 1 skipped in 2.0s")."""
    lines = [
        x for x in text.splitlines() if re.search(r"\b(passed|failed|skipped|error|errors|no tests ran)\b", x)
    ]
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    if lines:
        for n, word in re.findall(
            r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", lines[-1]
        ):
            key = "errors" if word.startswith("error") else word
            counts[key] = counts.get(key, 0) + int(n)
    return counts


def training_figures(data: dict, datasheet: dict | None, device: str) -> dict:
    figures = {
        k: data[k]
        for k in (
            "preset",
            "parameters",
            "seq",
            "micro_batch",
            "tokens_per_s",
            "mfu",
            "peak_flops",
            "peak_source",
        )
        if k in data
    }
    figures["final_loss"] = data.get("final_loss")
    figures["achieved_tflops"] = data["mfu"] * data["peak_flops"] / 1e12
    figures["peak_is_datasheet"] = str(data.get("peak_source", "")).startswith("datasheet")
    if datasheet:
        figures["datasheet_peak_flops"] = datasheet["flops"]
        figures["datasheet_peak_source"] = datasheet["source"]
    return figures


def hf_figures(data: dict) -> dict:
    median = data["median"]
    hf, sf = median["hf"], median["shardforge"]
    return {
        "preset": data["args"]["preset"],
        "records": data["args"]["records"],
        "hf_target_tokens_per_s": hf["target_tokens_per_s"],
        "shardforge_target_tokens_per_s": sf["target_tokens_per_s"],
        "ratio_target_tokens": median["speedup_target_tokens"],
        "ratio_process": median["speedup_process"],
        "hf_process_s": hf["process_s"],
        "shardforge_process_s": sf["process_s"],
        "hf_held_out_loss": hf["held_out_loss"],
        "shardforge_held_out_loss": sf["held_out_loss"],
        "shardforge_mfu": sf.get("mfu"),
    }


def inference_figures(data: dict, output: str) -> dict:
    runs = {r["variant"]: r["output_tokens_per_s"] for r in data["runs"]}
    engine = next((v for k, v in runs.items() if k.startswith("shardforge engine")), None)
    one = next((v for k, v in runs.items() if k.endswith("one at a time")), None)
    padded = {k: v for k, v in runs.items() if k.startswith("transformers generate, padded")}
    best = max([v for k, v in runs.items() if k.startswith("transformers")], default=None)
    if engine is None or best is None:
        raise ValueError(f"the engine's or transformers' figures are missing: {sorted(runs)}")
    # "tokens = transformers one at a time", the table's last column: greedy agreement per variant
    agreement = {}
    for row in re.findall(r"(?m)^\| (.+?) \|.*\| (\d+)% \|$", output):
        agreement[row[0]] = int(row[1]) / 100
    return {
        "size": data["args"]["size"],
        "requests": data["args"]["requests"],
        "dtype": data["args"]["dtype"],
        "engine_tokens_per_s": engine,
        "generate_one_at_a_time_tokens_per_s": one,
        "generate_padded_tokens_per_s": padded,
        "ratio_vs_one_at_a_time": engine / one if one else None,
        "ratio_vs_best_generate": engine / best,
        "same_tokens_as_one_at_a_time": agreement,
    }


# ---- the check --------------------------------------------------------------------------------------------
ENV_PROBE = r"""
import importlib.metadata as md, json, os, platform, sys
out = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
       "cpus": os.cpu_count()}
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
for name in ("torch", "transformers", "accelerate", "peft", "pytest", "pytest-timeout", "safetensors",
             "tokenizers", "numpy"):
    out[name] = version(name)
import torch, transformers, shardforge
from shardforge.planner.peak import datasheet_peak
out["shardforge"] = shardforge.__version__
out["shardforge_from"] = os.path.dirname(shardforge.__file__)
out["torch_cuda"] = torch.version.cuda
out["cuda_available"] = torch.cuda.is_available()
want = sys.argv[1]
if want == "cuda":
    if not torch.cuda.is_available():
        print("ENV " + json.dumps(out)); sys.exit("no CUDA device is visible to torch")
    props = torch.cuda.get_device_properties(0)
    out.update(device_name=torch.cuda.get_device_name(0), device_count=torch.cuda.device_count(),
               memory_gib=round(props.total_memory / 2**30, 1), capability=f"{props.major}.{props.minor}",
               bf16_supported=torch.cuda.is_bf16_supported())
    known = datasheet_peak(out["device_name"], torch.bfloat16)
    out["datasheet_peak"] = {"flops": known[0], "source": known[1]} if known else None
else:
    names = [l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")]
    model = names[0] if names else platform.processor() or "cpu"
    out.update(device_name=model, device_count=1, datasheet_peak=None)
print("ENV " + json.dumps(out))
"""


class Check:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.device = args.device
        self.out = Path(args.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.results: dict[str, Result] = {}
        self.started = time.perf_counter()
        self.env = {**os.environ, **OFFLINE}
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        if self.device == "cpu":
            self.env["CUDA_VISIBLE_DEVICES"] = ""  # a dry run stays on the CPU even on a GPU machine
            self.env["SHARDFORGE_TEST_DEVICE"] = "cpu"
        self.environment: dict = {}

    def left(self) -> float:
        return self.args.budget - (time.perf_counter() - self.started)

    def part(self, name: str, body: Callable[[float, Path], Result]) -> None:
        index = len(self.results) + 1
        log = self.out / f"{name}.log"
        log.unlink(missing_ok=True)
        timeout = min(TIMEOUTS[name] * self.args.timeout_scale, self.left() - 5)
        if timeout < 15:
            result = Result("skipped", why=f"the time budget ({self.args.budget:.0f} s) is spent")
        else:
            try:
                result = body(timeout, log)
            except Exception as exc:  # a parser that meets output it does not expect: report, go on
                text = log.read_text(errors="replace") if log.exists() else ""
                result = Result("failed", why=f"{type(exc).__name__}: {exc}", tail=tail(text))
        result.log = str(log) if log.exists() else ""
        self.results[name] = result
        line = f"[{index}/6] {name}: {result.status} in {result.seconds:.1f} s"
        line += f" ({result.why})" if result.why else ""
        line += f": {brief(name, result.figures)}" if result.figures else ""
        print(line, flush=True)
        if result.status == "failed" and result.tail:
            print("    " + result.tail.replace("\n", "\n    "), flush=True)

    def subprocess_part(
        self, cmd: list[str], timeout: float, log: Path, parse: Callable[[str], dict] | None = None
    ) -> Result:
        rc, output, seconds = run_command(cmd, self.env, timeout, log)
        result = Result("ok", seconds=seconds, command=cmd)
        if rc is None:
            return Result("failed", seconds, f"timed out after {timeout:.0f} s", cmd, tail=tail(output))
        if rc != 0:
            return Result("failed", seconds, f"exit code {rc}", cmd, tail=tail(output))
        if parse:
            try:
                result.figures = parse(output)
            except (ValueError, KeyError, TypeError, OSError) as exc:
                return Result("failed", seconds, f"could not read its figures: {exc}", cmd, tail=tail(output))
        return result

    def cuda_missing(self) -> Result | None:
        if self.device == "cuda" and not self.environment.get("cuda_available", True):
            return Result("skipped", why="no CUDA device (see the environment part)")
        return None

    # -- the parts
    def install(self, timeout: float, log: Path) -> Result:
        if not self.args.wheelhouse:
            return Result("skipped", why="no --wheelhouse given: using the packages already installed")
        wh = Path(self.args.wheelhouse).resolve()
        if not (wh / "constraints.txt").is_file():
            return Result("failed", why=f"{wh}/constraints.txt not found (scripts/wheelhouse.sh writes it)")
        cmd = [self.args.python, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wh)]
        cmd += ["-c", str(wh / "constraints.txt"), "shardforge[gpucheck]"]
        result = self.subprocess_part(cmd, timeout, log)
        if result.status == "failed" and "externally-managed-environment" in log.read_text(errors="replace"):
            spent = result.seconds
            result = self.subprocess_part([*cmd, "--break-system-packages"], timeout - spent, log)
            result.seconds += spent
        return result

    def probe_environment(self, timeout: float, log: Path) -> Result:
        cmd = [self.args.python, "-c", ENV_PROBE, self.device]
        rc, output, seconds = run_command(cmd, self.env, timeout, log)
        line = next((x for x in output.splitlines() if x.startswith("ENV ")), None)
        self.environment = json.loads(line[4:]) if line else {}
        if rc != 0 or line is None:
            why = "timed out" if rc is None else f"exit code {rc}"
            return Result(
                "failed", seconds, why, ["python", "-c", "<probe>"], self.environment, tail=tail(output)
            )
        return Result("ok", seconds, "", ["python", "-c", "<probe>"], self.environment)

    def cuda_tests(self, timeout: float, log: Path) -> Result:
        if missing := self.cuda_missing():
            return missing
        folder = REPO / "tests" / "cuda"
        cmd = [
            self.args.python,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--timeout=120",
            "tests/cuda",
        ]
        if not folder.is_dir():
            return Result("no tests", why="tests/cuda does not exist yet", command=cmd)
        rc, output, seconds = run_command(cmd, self.env, timeout, log)
        counts = pytest_counts(output)
        if rc == 5:
            return Result("no tests", seconds, "pytest collected no tests (exit 5)", cmd, counts)
        if rc is None:
            return Result(
                "failed", seconds, f"timed out after {timeout:.0f} s", cmd, counts, tail=tail(output)
            )
        if rc != 0:
            return Result("failed", seconds, f"exit code {rc}", cmd, counts, tail=tail(output))
        return Result("ok", seconds, "", cmd, counts)

    def training(self, timeout: float, log: Path) -> Result:
        if missing := self.cuda_missing():
            return missing
        cmd = [
            self.args.python,
            "benchmarks/single_process.py",
            "--device",
            self.device,
            "--precision",
            "bf16",
        ]
        cmd += SIZES[self.device]["training"].split()
        if self.args.peak_flops:
            cmd += ["--peak-flops", str(self.args.peak_flops)]
        datasheet = self.environment.get("datasheet_peak")
        result = self.subprocess_part(
            cmd, timeout, log, lambda out: training_figures(first_json_object(out), datasheet, self.device)
        )
        figures = result.figures
        if result.status == "ok" and self.device == "cuda" and not figures["peak_is_datasheet"]:
            result.why = f"MFU is not against a datasheet peak: {figures['peak_source']}"
        return result

    def vs_hf_trainer(self, timeout: float, log: Path) -> Result:
        if missing := self.cuda_missing():
            return missing
        json_out = self.out / "vs_hf_trainer.json"
        json_out.unlink(missing_ok=True)
        cmd = [
            self.args.python,
            "benchmarks/vs_hf_trainer.py",
            "--device",
            self.device,
            "--precision",
            "bf16",
        ]
        cmd += [*SIZES[self.device]["vs_hf_trainer"].split(), "--out", str(json_out)]
        return self.subprocess_part(
            cmd, timeout, log, lambda _out: hf_figures(json.loads(json_out.read_text()))
        )

    def inference(self, timeout: float, log: Path) -> Result:
        if missing := self.cuda_missing():
            return missing
        json_out = self.out / "inference.json"
        json_out.unlink(missing_ok=True)
        cmd = [self.args.python, "benchmarks/inference.py", "--device", self.device, "--dtype", "bfloat16"]
        cmd += [*SIZES[self.device]["inference"].split(), "--skip", "continuous", "--out", str(json_out)]
        return self.subprocess_part(
            cmd, timeout, log, lambda out: inference_figures(json.loads(json_out.read_text()), out)
        )

    def run(self) -> int:
        print(
            f"gpu_check: --device {self.device}, budget {self.args.budget:.0f} s, writing {self.out}",
            flush=True,
        )
        self.part("install", self.install)
        self.part("environment", self.probe_environment)
        self.part("cuda_tests", self.cuda_tests)
        self.part("training", self.training)
        self.part("vs_hf_trainer", self.vs_hf_trainer)
        self.part("inference", self.inference)
        total = time.perf_counter() - self.started
        summary = {
            "device": self.device,
            "device_name": self.environment.get("device_name"),
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "total_s": total,
            "budget_s": self.args.budget,
            "ok": not any(r.status == "failed" for r in self.results.values()),
            "parts": {name: vars(r) for name, r in self.results.items()},
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        text = summary_text(summary)
        (self.out / "summary.txt").write_text(text)
        print("\n" + text, flush=True)
        return 0 if summary["ok"] else 1


# ---- the text summary ------------------------------------------------------------------------------------
def _num(x: float | None, fmt: str = ",.0f") -> str:
    return "-" if x is None else format(x, fmt)


def brief(name: str, f: dict) -> str:
    """One line of a part's figures."""
    if name == "environment":
        return (
            f"{f.get('device_name')}; python {f.get('python')}, torch {f.get('torch')} "
            f"(CUDA {f.get('torch_cuda')}), transformers {f.get('transformers')}, "
            f"shardforge {f.get('shardforge')}"
        )
    if name == "cuda_tests":
        return ", ".join(f"{v} {k}" for k, v in f.items() if v or k == "passed")
    if name == "training":
        return (
            f"{f['preset']} ({f['parameters'] / 1e6:.4g}M parameters), "
            f"rows of {f['seq']} x {f['micro_batch']}: "
            f"{_num(f['tokens_per_s'])} tokens/s, MFU {100 * f['mfu']:.3g}% ({f['achieved_tflops']:.3g} of "
            f"{f['peak_flops'] / 1e12:.4g} TFLOP/s)"
        )
    if name == "vs_hf_trainer":
        return (
            f"{f['preset']}: target tokens/s shardforge {_num(f['shardforge_target_tokens_per_s'])} vs HF "
            f"Trainer {_num(f['hf_target_tokens_per_s'])} = {f['ratio_target_tokens']:.2f}x; whole process "
            f"{f['ratio_process']:.2f}x faster; held-out loss {f['shardforge_held_out_loss']:.3f} vs "
            f"{f['hf_held_out_loss']:.3f}"
        )
    if name == "inference":
        one = f["ratio_vs_one_at_a_time"]
        return (
            f"{f['size']} {f['dtype']}, {f['requests']} requests: engine {_num(f['engine_tokens_per_s'])} "
            f"output tokens/s = {_num(one, '.2f')}x generate one at a time, "
            f"{f['ratio_vs_best_generate']:.2f}x the best generate variant"
        )
    return json.dumps(f)[:200]


def summary_text(summary: dict) -> str:
    parts = summary["parts"]
    rows = [("part", "status", "seconds", "figures")]
    for name, r in parts.items():
        what = brief(name, r["figures"]) if r["figures"] else ""
        if r["why"]:
            what = f"{r['why']}; {what}" if what else r["why"]
        rows.append((name, r["status"], f"{r['seconds']:.1f}", what))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [
        f"gpu_check on {summary['device']} ({summary['device_name']}), {summary['finished']}: "
        f"{'all parts ok' if summary['ok'] else 'SOME PARTS FAILED'}, {summary['total_s']:.0f} s in all "
        f"(budget {summary['budget_s']:.0f} s)",
        "",
    ]
    for i, row in enumerate(rows):
        lines.append(
            "  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths, strict=True)) + "  " + row[3]
        )
        if i == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 7)
    train = parts.get("training", {}).get("figures") or {}
    if train:
        lines += [
            "",
            f"MFU peak used: {train['peak_flops'] / 1e12:.4g} TFLOP/s per device ({train['peak_source']})",
        ]
        if train.get("datasheet_peak_flops"):
            lines.append(
                f"datasheet dense bf16 peak of this device: {train['datasheet_peak_flops'] / 1e12:.4g} "
                f"TFLOP/s ({train['datasheet_peak_source']})"
            )
    inf = parts.get("inference", {}).get("figures") or {}
    if inf.get("same_tokens_as_one_at_a_time"):
        same = ", ".join(f"{k}: {v:.0%}" for k, v in inf["same_tokens_as_one_at_a_time"].items())
        lines += ["", f"greedy tokens equal to generate one at a time: {same}"]
    for name, r in parts.items():
        if r["status"] == "failed" and r["tail"]:
            lines += ["", f"{name} failed ({r['why']}); the end of {r['log'] or 'its output'}:", r["tail"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", default="runs/gpu_check", help="the folder for the summaries and logs")
    parser.add_argument(
        "--wheelhouse", default=None, help="install shardforge[gpucheck] from this folder first"
    )
    parser.add_argument(
        "--python", default=sys.executable or "python3", help="the Python that runs the parts"
    )
    parser.add_argument("--budget", type=float, default=570.0, help="seconds for the whole check")
    parser.add_argument(
        "--timeout-scale",
        type=float,
        default=1.0,
        help="each part's own time limit times this (a loaded machine's dry run: limits only stop a hang)",
    )
    parser.add_argument(
        "--peak-flops",
        type=float,
        default=None,
        help="MFU denominator for a GPU missing from planner/peak.py",
    )
    args = parser.parse_args(argv)
    return Check(args).run()


if __name__ == "__main__":
    sys.exit(main())
