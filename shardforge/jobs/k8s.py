"""A Kubernetes manifest for a JobSpec: the config as a ConfigMap, and one pod per node running a
`shardforge train` agent (the image of docker/Dockerfile) that meets the others in torch's c10d rendezvous at
the first pod. Two ways to get pods that can find the first one: an indexed Job (batch/v1) with a headless
Service, so pod 0 is `NAME-0.NAME`; or a Kubeflow training-operator PyTorchJob, whose Master pod is
`NAME-master-0`. Checkpoints (and so resuming after a restart) go to a volume mounted in every pod."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import yaml

from shardforge.errors import ShardforgeError
from shardforge.jobs.spec import JobSpec

KINDS = ("indexed-job", "pytorchjob")
CONFIG_DIR = "/etc/shardforge"  # the ConfigMap's mount
OUTPUT_ROOT = "/opt/shardforge/runs"  # the image's runs folder (docker/Dockerfile: WORKDIR /opt/shardforge)
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")  # an RFC 1123 DNS label
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
_CONFIGMAP_LIMIT = 1 << 20  # bytes a ConfigMap holds


@dataclass(frozen=True)
class K8sOptions:
    """What Kubernetes needs beyond the job: the kind of object, the image and where the run folder lives."""

    kind: str = "indexed-job"  # or "pytorchjob" (needs the Kubeflow training operator)
    image: str = "shardforge:latest"
    pvc: str | None = None  # a PersistentVolumeClaim for the run folder (ReadWriteMany for several nodes)
    namespace: str | None = None


def _check(spec: JobSpec, options: K8sOptions, config_text: str) -> None:
    if options.kind not in KINDS:
        raise ShardforgeError(f"--k8s-kind {options.kind!r}: expected one of {', '.join(KINDS)}")
    # The longest name made from it: a pod's hostname (indexed Job) or a replica's Service (PyTorchJob).
    suffix = f"-worker-{spec.nodes - 2}" if options.kind == "pytorchjob" else f"-{spec.nodes - 1}"
    longest = 63 - len(suffix)
    if not _LABEL.fullmatch(spec.name) or len(spec.name) > longest:
        raise ShardforgeError(
            f"--name {spec.name!r}: a Kubernetes name is at most {longest} lowercase letters, digits and '-' "
            "here, starting and ending with a letter or digit"
        )
    namespace = options.namespace
    if namespace is not None and not (_LABEL.fullmatch(namespace) and len(namespace) <= 63):
        raise ShardforgeError(f"--namespace {namespace!r}: not a Kubernetes namespace name")
    if options.pvc is not None and not (_SUBDOMAIN.fullmatch(options.pvc) and len(options.pvc) <= 253):
        raise ShardforgeError(f"--pvc {options.pvc!r}: not a PersistentVolumeClaim name")
    if not options.image or re.search(r"\s", options.image):
        raise ShardforgeError(
            f"--image {options.image!r}: expected an image reference, e.g. shardforge:latest"
        )
    if len(config_text.encode()) >= _CONFIGMAP_LIMIT:
        raise ShardforgeError(f"{spec.config_path}: too large for a ConfigMap (1 MiB at most)")


def _meta(name: str, options: K8sOptions, labels: dict[str, str]) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": dict(labels)}
    if options.namespace is not None:
        meta["namespace"] = options.namespace
    return meta


def _restarts(spec: JobSpec) -> tuple[str, int]:
    """restartPolicy and backoffLimit. The agent restarts the ranks of every pod (`--max-restarts`) inside
    the pods; Kubernetes restarts a pod whose agent itself died (a lost node, an OOM-killed agent), and
    with that agent gone every pod's agent fails once: so as many pod failures per job restart as nodes."""
    if spec.max_restarts == 0:
        return "Never", 0
    return "OnFailure", spec.max_restarts * spec.nodes


def _pod(
    spec: JobSpec, options: K8sOptions, endpoint: str, container: str, port_name: str, labels: dict[str, str]
) -> dict[str, Any]:
    """The pod template: every node's agent, the config and run-folder volumes, the node's GPUs."""
    output_dir = f"{OUTPUT_ROOT}/{PurePosixPath(spec.output_dir).name or 'default'}"
    args = spec.train_args(f"{CONFIG_DIR}/config.yaml", (f"output_dir={output_dir}",))
    args += ["--rdzv-endpoint", endpoint, "--rdzv-id", spec.name]
    main: dict[str, Any] = {
        "name": container,
        "image": options.image,
        "command": ["shardforge"],
        "args": args,
        "ports": [{"name": port_name, "containerPort": spec.rdzv_port}],
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "output", "mountPath": OUTPUT_ROOT},
            {"name": "dshm", "mountPath": "/dev/shm"},  # NCCL and data workers: more than the 64 MiB default
        ],
    }
    if spec.gpus:
        main["resources"] = {"limits": {"nvidia.com/gpu": str(spec.procs_per_node)}}
    output = (
        {"persistentVolumeClaim": {"claimName": options.pvc}} if options.pvc is not None else {"emptyDir": {}}
    )
    volumes = [
        {"name": "config", "configMap": {"name": f"{spec.name}-config"}},
        {"name": "output", **output},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]
    return {"metadata": {"labels": dict(labels)}, "spec": {"containers": [main], "volumes": volumes}}


def manifest_objects(spec: JobSpec, options: K8sOptions, config_text: str) -> list[dict[str, Any]]:
    """The objects, in the order `kubectl apply -f` should create them."""
    _check(spec, options, config_text)
    labels = {"app.kubernetes.io/name": "shardforge", "app.kubernetes.io/instance": spec.name}
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(f"{spec.name}-config", options, labels),
        "data": {"config.yaml": config_text},
    }
    restart_policy, backoff = _restarts(spec)
    if options.kind == "pytorchjob":
        pod = _pod(
            spec, options, f"{spec.name}-master-0:{spec.rdzv_port}", "pytorch", "pytorchjob-port", labels
        )
        replicas = {"Master": {"replicas": 1, "restartPolicy": restart_policy, "template": pod}}
        if spec.nodes > 1:
            replicas["Worker"] = {
                "replicas": spec.nodes - 1,
                "restartPolicy": restart_policy,
                "template": pod,
            }
        job = {
            "apiVersion": "kubeflow.org/v1",
            "kind": "PyTorchJob",
            "metadata": _meta(spec.name, options, labels),
            "spec": {"runPolicy": {"backoffLimit": backoff}, "pytorchReplicaSpecs": replicas},
        }
        return [config_map, job]
    pod = _pod(spec, options, f"{spec.name}-0.{spec.name}:{spec.rdzv_port}", "shardforge", "rdzv", labels)
    pod["spec"] = {"subdomain": spec.name, "restartPolicy": restart_policy, **pod["spec"]}
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(spec.name, options, labels),
        "spec": {
            "clusterIP": "None",  # headless: a DNS name per pod, pod 0's is the rendezvous endpoint
            "publishNotReadyAddresses": True,  # resolvable before any readiness
            "selector": dict(labels),
            "ports": [{"name": "rdzv", "port": spec.rdzv_port, "targetPort": spec.rdzv_port}],
        },
    }
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _meta(spec.name, options, labels),
        "spec": {
            "completionMode": "Indexed",  # pod i is NAME-i
            "completions": spec.nodes,
            "parallelism": spec.nodes,
            "backoffLimit": backoff,
            "template": pod,
        },
    }
    return [config_map, service, job]


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the shipped config) as literal blocks, readable as the file was."""


def _string(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _string)


def render_manifest(spec: JobSpec, options: K8sOptions, config_text: str) -> str:
    """The manifest's text: the objects as YAML documents in one file (`kubectl apply -f FILE`)."""
    objects = manifest_objects(spec, options, config_text)
    _, backoff = _restarts(spec)
    volume = f"PersistentVolumeClaim {options.pvc}" if options.pvc else "an emptyDir, lost with its pod"
    header = [
        f"# shardforge job {spec.name}: {spec.nodes} node(s) x {spec.procs_per_node} process(es), written by",
        f"# `shardforge launch --k8s --k8s-kind {options.kind}`. Create it with: kubectl apply -f THIS_FILE",
        "# One pod per node runs a `shardforge train` agent; the agents meet in torch's c10d rendezvous at",
        "# the first pod and start their node's ranks. After a rank fails, every pod's ranks restart (at",
        f"# most --max-restarts {spec.max_restarts} times) and resume from the newest checkpoint in the run",
        f"# folder under {OUTPUT_ROOT}: {volume}.",
        f"# backoffLimit {backoff}: pods whose agent died are restarted too (each such restart fails every",
        "# node's pod once).",
    ]
    body = yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, explicit_start=True, width=100)
    return "\n".join(header) + "\n" + body


def manifest_warnings(spec: JobSpec, options: K8sOptions) -> list[str]:
    """What would lose the run's checkpoints or final model."""
    if options.pvc is not None:
        return []
    shared = " and a multi-node checkpoint would be split over the pods" if spec.nodes > 1 else ""
    return [
        f"no --pvc: the run folder is each pod's emptyDir, so checkpoints and the final model are lost with "
        f"the pod{shared}; give --pvc NAME (a ReadWriteMany PersistentVolumeClaim for several nodes)"
    ]
