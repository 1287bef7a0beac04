"""Fault tolerance: a hung rank is diagnosed (which rank, doing what, every rank's stacks) and the job ends;
a killed rank makes a `--max-restarts` job restart and resume from its latest checkpoint, with the same result
as a run that was never killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from tests.conftest import REPO, alpaca_records, tiny_config, write_jsonl
from tests.dist._harness import _free_port
from tests.dist._training import logged


def test_a_hung_rank_is_reported_with_stacks_and_the_job_exits(tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", alpaca_records(40, seed=1))
    cfg = tiny_config(
        tmp_path, data, parallel={"zero_stage": 3, "timeout_minutes": 0.25}, checkpoint={"save_final": False}
    )
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(REPO / "tests/dist/_hang_job.py"), str(path)],
                env=env,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = [p.communicate(timeout=240) for p in procs]
    codes = [p.returncode for p in procs]
    assert all(code != 0 for code in codes), codes
    waiting, hung = outs[0][1], outs[1][1]
    # The rank that waited names itself and the collective phase it was in, then its stacks follow.
    assert "rank 0 has waited" in waiting and "step 2: forward/backward of micro-step 1/1" in waiting
    assert "Python stacks of every thread" in waiting
    # The hung rank's watchdog reports it too, with the stack showing where it is stuck.
    assert codes[1] == 3
    assert "shardforge watchdog: no progress" in hung and "rank 1 has waited" in hung
    assert "in: step 2: waiting for this step's batch" in hung  # stuck before its first collective of step 2
    assert "step_then_hang" in hung


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    kids = [int(x) for x in out.split()]
    return kids + [g for k in kids for g in _children(k)]


def _rank_of(pid: int) -> str | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    found = [e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"RANK=")]
    return found[0] if found else None


def _train(tmp_path, name: str, data, kill_at: Path | None) -> subprocess.CompletedProcess:
    cfg = tiny_config(
        tmp_path / name,
        data,
        train={"steps": 8, "micro_batch": 2, "lr": 3e-3, "warmup": 1, "log_every": 1},
        parallel={"zero_stage": 3},
        checkpoint={"every": 2, "save_final": False},
    )
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardforge", "train", str(path), "--nproc", "2", "--max-restarts", "1"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    killed = []

    def kill_rank_1_after_checkpoint() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if kill_at is not None and kill_at.exists():
                for pid in _children(proc.pid):
                    if _rank_of(pid) == "1":
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
                        return
            time.sleep(0.05)

    watcher = threading.Thread(target=kill_rank_1_after_checkpoint)
    watcher.start()
    out, err = proc.communicate(timeout=600)
    watcher.join()
    if kill_at is not None:
        assert killed, "rank 1 was never found to be killed"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_a_killed_rank_restarts_and_resumes_with_the_same_result(tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", alpaca_records(60, seed=2))
    plain = _train(tmp_path, "plain", data, None)
    assert plain.returncode == 0, plain.stderr
    killed = _train(tmp_path, "killed", data, tmp_path / "killed" / "run" / "checkpoints" / "step-00000004")
    assert killed.returncode == 0, killed.stderr
    assert "resumed from" in killed.stdout and "done: 8 steps" in killed.stdout
    metrics, reference = logged(tmp_path / "killed" / "run"), logged(tmp_path / "plain" / "run")
    assert [m["step"] for m in metrics] == list(range(1, 9))
    assert [m["loss"] for m in metrics] == [m["loss"] for m in reference]  # bit for bit, final loss included
