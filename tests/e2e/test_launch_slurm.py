"""`shardforge launch --slurm` end to end on a simulated SLURM: the generated batch script runs for real under
fake `srun` / `scontrol` / `sbatch` executables, two simulated nodes each running one `shardforge train`
agent with one CPU rank, joined by torch's c10d rendezvous; a killed rank restarts every node's ranks and the
run resumes from its checkpoint."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, alpaca_records, tiny_config, write_jsonl

pytestmark = pytest.mark.timeout(240)

# srun: its command once per simulated node, all at once, with the variables SLURM gives each task.
FAKE_SRUN = """#!/bin/bash
echo "$@" > "$FAKE_SLURM_DIR/srun.args"
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
pids=()
for ((i = 0; i < FAKE_SLURM_NODES; i++)); do
    SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 SLURM_NNODES=$FAKE_SLURM_NODES \\
        SLURM_NTASKS=$FAKE_SLURM_NODES "$@" > "$FAKE_SLURM_DIR/node$i.log" 2>&1 &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""
FAKE_SCONTROL = """#!/bin/bash
[ "$1 $2" = "show hostnames" ] && [ -n "$3" ] || { echo "fake scontrol: unexpected: $*" >&2; exit 1; }
printf 'localhost\\nlocalhost\\n'
"""
FAKE_SBATCH = """#!/bin/bash
echo "$@" > "$FAKE_SLURM_DIR/sbatch.args"
echo "Submitted batch job 4242"
"""


def _fake_slurm(tmp_path: Path, sbatch: bool = False) -> dict[str, str]:
    """A PATH with the fake SLURM commands first, and the variables sbatch sets for a job of 2 nodes."""
    bin_dir, logs = tmp_path / "fakebin", tmp_path / "slurm"
    bin_dir.mkdir()
    logs.mkdir()
    tools = {"srun": FAKE_SRUN, "scontrol": FAKE_SCONTROL} | ({"sbatch": FAKE_SBATCH} if sbatch else {})
    for name, text in tools.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "OMP_NUM_THREADS": "1",
        "FAKE_SLURM_DIR": str(logs),
        "FAKE_SLURM_NODES": "2",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node[001-002]",
        "SLURM_JOB_NUM_NODES": "2",
        "SHARDFORGE_TEST_JOB": uuid.uuid4().hex,  # marks this test's processes
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardforge", "launch", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=env,
    )


def _marked(marker: str, rank: str | None = None) -> list[int]:
    """This test's processes (its env marker), or those whose RANK is `rank` (torch elastic's workers: the
    agents have none)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = set((entry / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if f"SHARDFORGE_TEST_JOB={marker}".encode() in env and (
            rank is None or f"RANK={rank}".encode() in env
        ):
            found.append(int(entry.name))
    return found


def test_slurm_script_runs_two_agents_and_a_killed_rank_resumes(tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", alpaca_records(40, seed=3))
    cfg = tiny_config(
        tmp_path,
        data,
        train={"steps": 6, "micro_batch": 2, "lr": 3e-3, "warmup": 1, "log_every": 1},
        checkpoint={"every": 2},
    )
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    env = _fake_slurm(tmp_path)
    script = tmp_path / "job.sbatch"
    made = _launch(
        str(config), "--slurm", "--nodes", "2", "--gpus-per-node", "1", "--max-restarts", "1",
        "--rdzv-port", str(_free_port()), "--out", str(script), env=env,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert f"wrote {script}" in made.stdout and "warning" not in made.stdout
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0

    job = subprocess.Popen(
        ["bash", str(script)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    killed: list[int] = []

    def kill_rank_1_after_the_first_checkpoint() -> None:
        """Rank 1 dies while rank 0 is held still (SIGSTOP): node 0's agent must restart its healthy rank
        because node 1 rejoins the rendezvous, without counting a failure of its own; only then does rank 0
        go on (and get the agent's SIGTERM). The agents' restart counts now differ, as on a cluster."""
        marker, node0 = env["SHARDFORGE_TEST_JOB"], tmp_path / "slurm" / "node0.log"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and job.poll() is None:
            if (tmp_path / "run" / "checkpoints" / "step-00000002").exists():
                rank0, rank1 = _marked(marker, "0"), _marked(marker, "1")
                if rank0 and rank1:
                    os.kill(rank0[0], signal.SIGSTOP)
                    os.kill(rank1[0], signal.SIGKILL)
                    killed.append(rank1[0])
                    until = time.monotonic() + 30
                    while "closing signal SIGTERM" not in node0.read_text() and time.monotonic() < until:
                        time.sleep(0.05)
                    os.kill(rank0[0], signal.SIGCONT)
                    return
            time.sleep(0.05)

    watcher = threading.Thread(target=kill_rank_1_after_the_first_checkpoint)
    watcher.start()
    try:
        out, err = job.communicate(timeout=120)
    finally:
        for pid in _marked(env["SHARDFORGE_TEST_JOB"]) if job.poll() is None else ():  # fake srun's too
            os.kill(pid, signal.SIGKILL)
        watcher.join()
    logs = {p.name: p.read_text() for p in (tmp_path / "slurm").glob("node*.log")}
    assert job.returncode == 0, (out, err, logs)
    assert killed, "rank 1 was never found to be killed"
    assert "closing signal SIGTERM" in logs["node0.log"], logs  # node 0 restarted for node 1's failure

    # srun was asked for one task per node, each task an agent for 2 nodes x 1 rank meeting at the head node.
    srun_args = (tmp_path / "slurm" / "srun.args").read_text()
    assert srun_args.startswith("--nodes=2 --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=1 ")
    assert "--nproc 1 --nnodes 2 --max-restarts 1 --rdzv-endpoint localhost:" in srun_args
    assert srun_args.rstrip().endswith("--rdzv-id 4242")
    assert "rendezvous at localhost:" in out
    # One job of 2 ranks (rank 0's log says so once), restarted once, resumed from a checkpoint.
    both = "".join(logs.values())
    assert both.count("done: 6 steps") == 1, logs
    assert "on 2 rank(s)" in both and "resumed from" in both, logs
    run = tmp_path / "run"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 7))
    assert (run / "final" / "model.safetensors").is_file()


def test_submit_runs_sbatch_on_the_script(tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", alpaca_records(4))
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tmp_path, data, hardware={"devices_per_node": 2})))
    env = _fake_slurm(tmp_path, sbatch=True)
    proc = _launch(str(config), "--slurm", "--submit", "--nodes", "3", "--partition", "gpu", env=env)
    assert proc.returncode == 0, proc.stderr
    # Default place: the run's output_dir, said in the output; sbatch got that file.
    script = tmp_path / "run" / "shardforge-config.sbatch"
    assert f"wrote {script}" in proc.stdout and "Submitted batch job 4242" in proc.stdout
    assert (tmp_path / "slurm" / "sbatch.args").read_text().strip() == str(script)
    text = script.read_text()
    assert "#SBATCH --nodes=3" in text and "#SBATCH --gpus-per-node=2" in text
    assert "#SBATCH --partition=gpu" in text and "--nproc 2 --nnodes 3 --max-restarts 3" in text
    assert "checkpoint.every is unset" in proc.stdout  # restarts would start over

    # Without sbatch on PATH: one clear error, and nothing written.
    no_sbatch = {**env, "PATH": "/usr/bin:/bin"}
    other = tmp_path / "other.sbatch"
    proc = _launch(str(config), "--slurm", "--submit", "--out", str(other), env=no_sbatch)
    assert proc.returncode == 2 and "sbatch is not on PATH" in proc.stderr
    assert "Traceback" not in proc.stderr and not other.exists()
