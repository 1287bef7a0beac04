"""A SLURM batch script for a JobSpec: `srun` starts one `shardforge train` agent per node (one task per node;
the agents start the ranks, so SLURM's task variables never become ranks), with the allocation's first node
as the c10d rendezvous endpoint and the SLURM job id as the run id. Checkpoints, and so resuming after a
restart, need the output_dir on a filesystem every node sees, as SLURM clusters have."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from shardforge.errors import ShardforgeError
from shardforge.jobs.spec import JobSpec

# SLURM's time formats: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS (and no limit)
_TIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d+(:\d{1,2}){0,2}|infinite|unlimited|UNLIMITED")
# Options the script sets from the job itself: another value through --sbatch-arg would contradict them.
_OWN = {
    "--nodes": "--nodes",
    "-N": "--nodes",
    "--ntasks": "--nodes",
    "-n": "--nodes",
    "--ntasks-per-node": "--nodes",
    "--gpus-per-node": "--gpus-per-node",
    "--partition": "--partition",
    "-p": "--partition",
    "--time": "--time",
    "-t": "--time",
    "--account": "--account",
    "-A": "--account",
    "--job-name": "--name",
    "-J": "--name",
}


@dataclass(frozen=True)
class SlurmOptions:
    """What SLURM needs beyond the job: where it runs, for how long, and how a node runs shardforge."""

    partition: str | None = None
    time: str | None = None  # a SLURM time limit, e.g. 2-00:00:00
    account: str | None = None
    extra: tuple[str, ...] = ()  # more #SBATCH options, e.g. --exclusive, --mem=0, --qos=high
    workdir: str | None = None  # --chdir: where the config's relative paths resolve
    log: str | None = None  # --output, e.g. runs/x/slurm-%j.out
    launcher: tuple[str, ...] = ("shardforge",)  # e.g. a virtual environment's python, -m, shardforge


def _option(arg: str) -> str:
    """`--mem=0` -> `--mem`; `-N 2` and `-N2` -> `-N`."""
    name = re.split(r"[=\s]", arg, maxsplit=1)[0]
    return name if name.startswith("--") else name[:2]


def _check(options: SlurmOptions, name: str) -> None:
    for flag, value in (("--name", name), ("--partition", options.partition), ("--account", options.account)):
        if value is not None and not re.fullmatch(r"[^\s'\"\\]+", value):
            raise ShardforgeError(f"{flag} {value!r}: expected one word (no spaces or quotes)")
    if options.time is not None and not _TIME.fullmatch(options.time):
        raise ShardforgeError(
            f"--time {options.time!r}: not a SLURM time limit (minutes, HH:MM:SS or D-HH:MM:SS, "
            "e.g. 2-00:00:00)"
        )
    for arg in options.extra:
        if not arg.startswith("-") or "\n" in arg or "\r" in arg:
            raise ShardforgeError(
                f"--sbatch-arg {arg!r}: expected one sbatch option on one line, e.g. --sbatch-arg=--exclusive"
            )
        if _option(arg) in _OWN:
            raise ShardforgeError(
                f"--sbatch-arg {arg!r}: the script sets {_option(arg)} from the job; use {_OWN[_option(arg)]}"
            )


def render_sbatch(spec: JobSpec, options: SlurmOptions) -> str:
    """The batch script's text (bash; `sbatch FILE` submits it)."""
    _check(options, spec.name)
    given = {_option(a) for a in options.extra}
    q = shlex.quote
    directives = [f"--job-name={q(spec.name)}", f"--nodes={spec.nodes}", "--ntasks-per-node=1"]
    if spec.gpus:
        directives.append(f"--gpus-per-node={spec.procs_per_node}")
    scheduling = {"partition": options.partition, "time": options.time, "account": options.account}
    for key, value in scheduling.items():
        if value is not None:
            directives.append(f"--{key}={q(value)}")
    if options.workdir is not None and not given & {"--chdir", "-D"}:
        directives.append(f"--chdir={q(options.workdir)}")
    if options.log is not None and not given & {"--output", "-o"}:
        directives.append(f"--output={q(options.log)}")
    directives += options.extra
    # One line for the command and config, one for the overrides, one for the agent's flags.
    argv = spec.train_args()
    split = 2 + len(spec.overrides)
    parts = [argv[:2], argv[2:split], argv[split:]]
    command = " \\\n    ".join(
        shlex.join(part) for part in ([*options.launcher, *parts[0]], *parts[1:]) if part
    )
    restarts = f"up to {spec.max_restarts} time(s)" if spec.max_restarts else "never (--max-restarts 0)"
    lines = [
        "#!/bin/bash",
        f"# shardforge job {spec.name}: {spec.nodes} node(s) x {spec.procs_per_node} process(es), written by",
        "# `shardforge launch --slurm`. Submit it with: sbatch THIS_FILE",
        "# srun starts one `shardforge train` agent per node; the agents meet in torch's c10d rendezvous on",
        "# the allocation's first node (run id: the SLURM job id) and start their node's ranks. After a rank",
        f"# fails, every node's ranks restart, {restarts}, and resume from the newest complete checkpoint in",
        f"# {spec.output_dir} (checkpoint.resume: auto), which every node must see (a shared filesystem).",
        *(f"#SBATCH {d}" for d in directives),
        "",
        "set -eu",
        "",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        'if [ -z "$head_node" ]; then',
        '    echo "shardforge: no first node in SLURM_JOB_NODELIST" >&2',
        "    exit 1",
        "fi",
        f"rdzv_port={spec.rdzv_port}",
        "# srun no longer inherits sbatch's --cpus-per-task (Slurm 22.05+): pass it on to the agents",
        'if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"; fi',
        f'echo "shardforge: {spec.name} on {spec.nodes} node(s), rendezvous at $head_node:$rdzv_port, '
        'run id $SLURM_JOB_ID"',
        "",
        f"srun --nodes={spec.nodes} --ntasks={spec.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 \\",
        f"    {command} \\",
        '    --rdzv-endpoint "$head_node:$rdzv_port" --rdzv-id "$SLURM_JOB_ID"',
        "",
    ]
    return "\n".join(lines)


def require_sbatch() -> str:
    """sbatch's path, or an error that says where the script can still be submitted from."""
    found = shutil.which("sbatch")
    if found is None:
        raise ShardforgeError(
            "--submit: sbatch is not on PATH (not a SLURM login node?); leave out --submit to only write "
            "the script, then run `sbatch FILE` where SLURM is"
        )
    return found


def submit(script: Path) -> str:
    """Submit the script with sbatch; sbatch's answer (e.g. "Submitted batch job 42")."""
    proc = subprocess.run([require_sbatch(), str(script)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        message = (proc.stderr or proc.stdout).strip() or "no message"
        raise ShardforgeError(f"sbatch {script} failed (exit code {proc.returncode}): {message}")
    return proc.stdout.strip()
