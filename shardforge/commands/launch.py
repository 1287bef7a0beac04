"""`shardforge launch`: the multi-node job file (SLURM batch script or Kubernetes manifest) for a config; the
command's flags and its handler. Thin: jobs/ renders the files."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rich.console import Console

from shardforge.commands.arg_types import at_least
from shardforge.errors import ModelError, ShardforgeError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p_launch = sub.add_parser(
        "launch",
        help="write a multi-node job: a SLURM batch script (--slurm, --submit runs sbatch) or a Kubernetes "
        "manifest (--k8s); one `shardforge train` agent per node, c10d rendezvous, restarts resume",
    )
    p_launch.add_argument("config", help="path to the YAML config")
    p_launch.add_argument("overrides", nargs="*", help="dotted overrides, e.g. checkpoint.every=500")
    target = p_launch.add_mutually_exclusive_group(required=True)
    target.add_argument("--slurm", action="store_true", help="a SLURM batch script")
    target.add_argument("--k8s", action="store_true", help="a Kubernetes manifest (multi-document YAML)")
    p_launch.add_argument("--submit", action="store_true", help="--slurm: submit the script with sbatch")
    p_launch.add_argument("--nodes", type=at_least(1), help="nodes (default: hardware.nodes)")
    p_launch.add_argument(
        "--gpus-per-node",
        type=at_least(1),
        help="processes (one per GPU) per node (default: hardware.devices_per_node)",
    )
    p_launch.add_argument(
        "--max-restarts",
        type=at_least(0),
        default=3,
        help="restart every node's ranks this often after a failure; they resume from the newest checkpoint",
    )
    p_launch.add_argument("--rdzv-port", type=at_least(1), default=29500, help="rendezvous port on node 0")
    p_launch.add_argument("--name", help="job name (default: shardforge-<config file name>)")
    p_launch.add_argument("--out", help="the file to write (default: in the config's output_dir)")
    p_launch.add_argument("--partition", help="--slurm: the partition")
    p_launch.add_argument("--time", help="--slurm: the time limit, e.g. 2-00:00:00")
    p_launch.add_argument("--account", help="--slurm: the account charged")
    p_launch.add_argument(
        "--sbatch-arg",
        action="append",
        help="--slurm: one more #SBATCH option, repeatable, written with '=': --sbatch-arg=--exclusive "
        "(SLURM gives a task one CPU unless told: --exclusive or --cpus-per-task=N)",
    )
    p_launch.add_argument(
        "--k8s-kind",
        choices=["indexed-job", "pytorchjob"],
        help="--k8s: a batch/v1 indexed Job with a headless Service (default), or a Kubeflow PyTorchJob",
    )
    p_launch.add_argument("--image", help="--k8s: the image (default shardforge:latest, docker/Dockerfile)")
    p_launch.add_argument(
        "--pvc", help="--k8s: PersistentVolumeClaim for the run folder (ReadWriteMany for several nodes)"
    )
    p_launch.add_argument("--namespace", help="--k8s: the objects' namespace")
    p_launch.set_defaults(func=cmd_launch)


def _preflight(config_path: str, spec: Any, console: Console) -> list[str]:
    """The job's layout through the preflight the ranks will run (degrees, shape rules, placement and memory
    on its nodes; `parallel: auto` resolved), before anything is written; the model's config.json is read
    where it is reachable from here, and the degrees are checked even where it is not (a warning says so)."""
    from shardforge.config import load_config
    from shardforge.models.build import planning_shape
    from shardforge.parallel.dims import ParallelDims
    from shardforge.planner.preflight import preflight

    config = load_config(config_path, list(spec.overrides))  # with the job's nodes and devices per node
    world = spec.nodes * spec.procs_per_node
    ParallelDims.from_config(config.parallel, world)
    try:
        shape = planning_shape(config.model)
    except ModelError as exc:
        return [
            f"the layout's shape rules and memory were not checked here (the model is not readable: {exc})"
        ]
    config, dims, _, _, estimate = preflight(config, world, shape, measure=False)
    chosen = f"{estimate.layout.describe()}, " if estimate is not None else ""
    memory = f"{estimate.memory.device_bytes / 2**30:.1f} GiB per device, " if estimate is not None else ""
    console.print(f"preflight: {chosen}{memory}{dims.describe()}", highlight=False, markup=False)
    return []


def cmd_launch(args: argparse.Namespace, console: Console) -> int:
    """A multi-node job file for the config (SLURM batch script or Kubernetes manifest), written, and with
    --submit given to sbatch. Every input is checked before anything is written."""
    from pathlib import Path

    from shardforge.config import load_config
    from shardforge.jobs import k8s, slurm
    from shardforge.jobs.spec import job_spec, restart_warnings

    slurm_flags = {"--partition": args.partition, "--time": args.time, "--account": args.account}
    slurm_flags["--sbatch-arg"] = args.sbatch_arg
    k8s_flags = {"--k8s-kind": args.k8s_kind, "--image": args.image, "--pvc": args.pvc}
    k8s_flags["--namespace"] = args.namespace
    other, target = (slurm_flags, "--slurm") if args.k8s else (k8s_flags, "--k8s")
    misplaced = [flag for flag, value in other.items() if value is not None]
    if misplaced:
        raise ShardforgeError(f"{', '.join(misplaced)}: only with {target}")
    if args.submit and args.k8s:
        raise ShardforgeError("--submit runs sbatch (with --slurm); for --k8s run kubectl apply -f FILE")
    config = load_config(args.config, args.overrides)  # a bad config fails here, before anything is written
    spec = job_spec(
        config,
        args.config,
        args.overrides,
        name=args.name,
        nodes=args.nodes,
        procs_per_node=args.gpus_per_node,
        max_restarts=args.max_restarts,
        rdzv_port=args.rdzv_port,
    )
    warnings = restart_warnings(config, spec.max_restarts) + _preflight(args.config, spec, console)
    if args.submit:
        slurm.require_sbatch()

    def render(out: Path) -> str:
        if args.k8s:
            kind, image = args.k8s_kind or "indexed-job", args.image or "shardforge:latest"
            options = k8s.K8sOptions(kind, image, args.pvc, args.namespace)
            return k8s.render_manifest(spec, options, Path(args.config).read_text())
        options = slurm.SlurmOptions(
            partition=args.partition,
            time=args.time,
            account=args.account,
            extra=tuple(args.sbatch_arg or ()),
            workdir=str(Path.cwd()),  # the config's relative paths resolve as they do here
            log=str(out.parent.resolve() / "slurm-%j.out"),
            launcher=(sys.executable, "-m", "shardforge"),  # this environment's shardforge, on every node
        )
        return slurm.render_sbatch(spec, options)

    file_name = f"{spec.name}.{'k8s.yaml' if args.k8s else 'sbatch'}"
    out = Path(args.out) if args.out else Path(config.output_dir) / file_name
    text = render(out)  # the flags' errors, before any folder is made
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        if args.out:
            raise ShardforgeError(f"--out {args.out}: cannot create {out.parent}: {exc.strerror}") from None
        out = Path.cwd() / file_name  # the run folder is not writable here (e.g. a cluster path)
        text = render(out)
    out.write_text(text)
    if args.slurm:
        out.chmod(0o755)
    if args.k8s:
        warnings += k8s.manifest_warnings(spec, k8s.K8sOptions(pvc=args.pvc))
    for message in warnings:
        console.print(f"[yellow]warning:[/] {message}", highlight=False)
    what = "Kubernetes manifest" if args.k8s else "SLURM batch script"
    console.print(
        f"wrote {out.resolve()}: {what} for {spec.name}, {spec.nodes} node(s) x {spec.procs_per_node} "
        f"process(es), up to {spec.max_restarts} restart(s)",
        highlight=False,
        markup=False,
    )
    if args.submit:
        console.print(slurm.submit(out), highlight=False, markup=False)
    else:
        console.print(f"start it with: {'kubectl apply -f' if args.k8s else 'sbatch'} {out}", markup=False)
    return 0
