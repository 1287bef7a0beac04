"""`shardforge launch`: the SLURM batch script and the Kubernetes manifests it writes (rendered, checked by
bash and by the Kubernetes client's object models), its errors, and `train`'s multi-node agent flags."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from shardforge import cli
from shardforge.config import load_config
from shardforge.errors import ShardforgeError
from shardforge.jobs.k8s import K8sOptions, manifest_objects, manifest_warnings, render_manifest
from shardforge.jobs.slurm import SlurmOptions, render_sbatch
from shardforge.jobs.spec import job_spec, restart_warnings
from tests.conftest import alpaca_records, tiny_config, write_jsonl

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def config_file(tmp_path) -> Path:
    data = write_jsonl(tmp_path / "a.jsonl", alpaca_records(4))
    path = tmp_path / "My Config.yaml"  # a space: every use of the path must be quoted
    path.write_text(yaml.safe_dump(tiny_config(tmp_path, data, checkpoint={"every": 10})))
    return path


def _spec(config_file: Path, overrides: tuple[str, ...] = (), **kw):
    config = load_config(config_file, list(overrides))
    kw = {"nodes": 2, "procs_per_node": 4, "max_restarts": 2, **kw}
    return job_spec(config, config_file, overrides, **kw)


# ---- the job ----------------------------------------------------------------------------------------------


def test_the_job_takes_its_shape_from_the_hardware_section_unless_told(config_file):
    config = load_config(config_file, ["hardware.nodes=3", "hardware.devices_per_node=8"])
    spec = job_spec(config, config_file, ["train.lr=1e-4"], max_restarts=1)
    assert (spec.nodes, spec.procs_per_node, spec.world) == (3, 8, 24)
    assert spec.name == "shardforge-my-config" and spec.config_path == str(config_file.resolve())
    assert spec.train_args() == [
        "train", str(config_file.resolve()), "train.lr=1e-4",
        "hardware.nodes=3", "hardware.devices_per_node=8",
        "--nproc", "8", "--nnodes", "3", "--max-restarts", "1",
    ]  # fmt: skip
    flags = job_spec(config, config_file, nodes=2, procs_per_node=1)
    assert flags.overrides[-2:] == ("hardware.nodes=2", "hardware.devices_per_node=1")  # the flags win
    with pytest.raises(ShardforgeError, match="--gpus-per-node is not given"):
        job_spec(load_config(config_file), config_file)
    with pytest.raises(ShardforgeError, match="--rdzv-port 70000"):
        job_spec(config, config_file, rdzv_port=70000)


def test_restart_warnings_say_when_a_restart_would_start_over(config_file):
    config = load_config(config_file)  # checkpoint.every=10, resume auto
    assert restart_warnings(config, 2) == []
    assert restart_warnings(load_config(config_file, ["checkpoint.every=null"]), 0) == []  # no restarts
    (unset,) = restart_warnings(load_config(config_file, ["checkpoint.every=null"]), 2)
    assert "checkpoint.every is unset" in unset and "starts the run over" in unset
    (none,) = restart_warnings(load_config(config_file, ["checkpoint.resume=none"]), 1)
    assert "checkpoint.resume=none" in none
    (fixed,) = restart_warnings(load_config(config_file, ["checkpoint.resume=/old/step-5"]), 1)
    assert "resumes from that checkpoint again" in fixed


# ---- SLURM ------------------------------------------------------------------------------------------------


def test_the_slurm_script_is_valid_bash_with_one_agent_per_node(config_file, tmp_path):
    spec = _spec(config_file, ("train.lr=1e-4",))
    options = SlurmOptions(
        partition="gpu", time="2-00:00:00", account="proj", extra=("--exclusive", "--mem=0"),
        workdir=str(tmp_path / "work dir"), log=str(tmp_path / "slurm-%j.out"),
        launcher=("/opt/venv/bin/python", "-m", "shardforge"),
    )  # fmt: skip
    text = render_sbatch(spec, options)
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    assert text.startswith("#!/bin/bash\n")
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert directives == [
        "#SBATCH --job-name=shardforge-my-config",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=2-00:00:00",
        "#SBATCH --account=proj",
        f"#SBATCH --chdir='{tmp_path / 'work dir'}'",
        f"#SBATCH --output={tmp_path / 'slurm-%j.out'}",
        "#SBATCH --exclusive",
        "#SBATCH --mem=0",
    ]
    # sbatch reads directives only before the first command
    first_command = next(i for i, line in enumerate(text.splitlines()) if line and not line.startswith("#"))
    assert all(i < first_command for i, line in enumerate(text.splitlines()) if line.startswith("#SBATCH"))
    assert 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)' in text
    assert "srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=1 \\" in text
    assert "--nproc 4 --nnodes 2 --max-restarts 2" in text
    assert text.rstrip().endswith('--rdzv-endpoint "$head_node:$rdzv_port" --rdzv-id "$SLURM_JOB_ID"')
    assert "rdzv_port=29500" in text


def test_the_slurm_script_passes_every_argument_intact(config_file, tmp_path):
    """Run the script with an srun that records its argv: quoting survives spaces, quotes and `$`."""
    tricky = "train.lr=1e-4", "output_dir=runs/it's $HOME"
    spec = _spec(config_file, tricky, rdzv_port=12345)
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(spec, SlurmOptions(launcher=("shardforge",))))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\nprintf "%s\\0" "$@" > "$ARGV_FILE"\n')
    (bin_dir / "scontrol").write_text('#!/bin/bash\nprintf "gpu-a17\\ngpu-a18\\n"\n')
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "ARGV_FILE": str(tmp_path / "argv"), "HOME": "/nowhere",
           "SLURM_JOB_ID": "777", "SLURM_JOB_NODELIST": "gpu-a[17-18]"}  # fmt: skip
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "rendezvous at gpu-a17:12345, run id 777" in proc.stdout
    argv = (tmp_path / "argv").read_text().split("\0")[:-1]
    assert argv == [
        "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
        "shardforge", "train", str(config_file.resolve()), *tricky,
        "hardware.nodes=2", "hardware.devices_per_node=4",
        "--nproc", "4", "--nnodes", "2", "--max-restarts", "2",
        "--rdzv-endpoint", "gpu-a17:12345", "--rdzv-id", "777",
    ]  # fmt: skip


def test_slurm_details_follow_the_config_and_the_user(config_file):
    cpu = render_sbatch(_spec(config_file, ("hardware.device=cpu",)), SlurmOptions())
    assert "--gpus-per-node" not in cpu and "--nproc 4" in cpu  # processes, but no GPUs asked of SLURM
    own = render_sbatch(
        _spec(config_file), SlurmOptions(workdir="/a", log="/b/%j", extra=("-D/c", "--output=x"))
    )
    assert "--chdir=/a" not in own and "--output=/b/%j" not in own  # the user's own win
    assert "#SBATCH -D/c" in own and "#SBATCH --output=x" in own
    assert "never (--max-restarts 0)" in render_sbatch(_spec(config_file, max_restarts=0), SlurmOptions())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (SlurmOptions(time="1h"), "--time '1h': not a SLURM time limit"),
        (SlurmOptions(partition="gpu a"), "--partition 'gpu a': expected one word"),
        (SlurmOptions(account="x'y"), "--account"),
        (SlurmOptions(extra=("exclusive",)), "--sbatch-arg 'exclusive': expected one sbatch option"),
        (SlurmOptions(extra=("--mem=0\nrm -rf /",)), "--sbatch-arg"),
        (SlurmOptions(extra=("--nodes=4",)), "the script sets --nodes from the job; use --nodes"),
        (SlurmOptions(extra=("-N4",)), "the script sets -N from the job; use --nodes"),
        (SlurmOptions(extra=("--gpus-per-node=2",)), "use --gpus-per-node"),
        (SlurmOptions(extra=("-J", "x")), "use --name"),
    ],
)
def test_bad_slurm_options_are_errors_naming_the_flag(config_file, options, message):
    with pytest.raises(ShardforgeError, match=message.replace("(", r"\(")):
        render_sbatch(_spec(config_file), options)


def test_slurm_times_in_every_format_are_accepted(config_file):
    for limit in ("90", "30:00", "12:00:00", "2-12", "2-12:30", "2-12:30:00", "infinite"):
        assert f"--time={limit}" in render_sbatch(_spec(config_file), SlurmOptions(time=limit))


# ---- Kubernetes -------------------------------------------------------------------------------------------


def _objects(config_file: Path, kind: str, pvc: str | None = None, nodes: int = 3, restarts: int = 2):
    spec = _spec(config_file, ("train.lr=1e-4",), nodes=nodes, max_restarts=restarts)
    options = K8sOptions(kind=kind, image="registry.example/shardforge:cuda", pvc=pvc, namespace="ml")
    text = render_manifest(spec, options, config_file.read_text())
    return spec, list(yaml.safe_load_all(text))


def _container(pod: dict) -> dict:
    (container,) = pod["spec"]["containers"]
    return container


def _check_pod(pod: dict, spec, config_map: dict, endpoint: str, pvc: str | None) -> None:
    """The pod of every node: the agent's command, the config from the ConfigMap, GPUs, the run folder."""
    container = _container(pod)
    assert container["image"] == "registry.example/shardforge:cuda" and container["command"] == ["shardforge"]
    args = container["args"]
    assert args[:2] == ["train", "/etc/shardforge/config.yaml"] and "train.lr=1e-4" in args
    assert args[args.index("--nproc") + 1] == "4" and args[args.index("--nnodes") + 1] == str(spec.nodes)
    assert args[args.index("--max-restarts") + 1] == str(spec.max_restarts)
    assert args[args.index("--rdzv-endpoint") + 1] == endpoint
    assert args[args.index("--rdzv-id") + 1] == spec.name
    assert f"output_dir=/opt/shardforge/runs/{Path(spec.output_dir).name}" in args
    assert container["resources"] == {"limits": {"nvidia.com/gpu": "4"}}
    assert {"containerPort": spec.rdzv_port}.items() <= container["ports"][0].items()
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert mounts["config"] == "/etc/shardforge"
    assert volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"]
    assert "config.yaml" in config_map["data"]
    assert mounts["output"] == "/opt/shardforge/runs"
    if pvc is None:
        assert volumes["output"] == {"name": "output", "emptyDir": {}}
    else:
        assert volumes["output"]["persistentVolumeClaim"] == {"claimName": pvc}
    assert set(mounts) == set(volumes)


def test_the_indexed_job_manifest(config_file):
    spec, docs = _objects(config_file, "indexed-job", pvc="runs-rwx")
    assert [d["kind"] for d in docs] == ["ConfigMap", "Service", "Job"]
    config_map, service, job = docs
    assert config_map["data"]["config.yaml"] == config_file.read_text()  # shipped as written
    assert all(d["metadata"]["namespace"] == "ml" for d in docs)
    assert job["apiVersion"] == "batch/v1" and job["metadata"]["name"] == spec.name
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 3
    assert job["spec"]["backoffLimit"] == 2 * 3
    pod = job["spec"]["template"]
    assert pod["spec"]["restartPolicy"] == "OnFailure"
    # The headless Service gives pod 0 the name NAME-0.SERVICE, the rendezvous endpoint.
    assert service["spec"]["clusterIP"] == "None" and pod["spec"]["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    endpoint = f"{spec.name}-0.{service['metadata']['name']}:{spec.rdzv_port}"
    _check_pod(pod, spec, config_map, endpoint, "runs-rwx")


def test_the_pytorchjob_manifest(config_file):
    spec, docs = _objects(config_file, "pytorchjob")
    assert [d["kind"] for d in docs] == ["ConfigMap", "PyTorchJob"]
    config_map, job = docs
    _check_pytorchjob_schema(job)
    assert job["spec"]["runPolicy"]["backoffLimit"] == 2 * 3
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 2
    for replica in replicas.values():
        assert replica["restartPolicy"] == "OnFailure"
        assert _container(replica["template"])["name"] == "pytorch"  # the operator's container name
        # The operator's Service for the Master pod is NAME-master-0.
        _check_pod(replica["template"], spec, config_map, f"{spec.name}-master-0:{spec.rdzv_port}", None)
    _, single = _objects(config_file, "pytorchjob", nodes=1, restarts=0)
    assert set(single[1]["spec"]["pytorchReplicaSpecs"]) == {"Master"}
    _check_pytorchjob_schema(single[1])
    assert single[1]["spec"]["pytorchReplicaSpecs"]["Master"]["restartPolicy"] == "Never"
    assert single[1]["spec"]["runPolicy"]["backoffLimit"] == 0


def _check_pytorchjob_schema(job: dict) -> None:
    """The fields of a kubeflow.org/v1 PyTorchJob (a CRD: the Kubernetes client has no model for it) that the
    training operator requires, with their types; the pod templates are checked as Kubernetes objects."""
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    assert set(job) == {"apiVersion", "kind", "metadata", "spec"}
    assert isinstance(job["metadata"]["name"], str)
    assert set(job["spec"]) <= {"runPolicy", "pytorchReplicaSpecs", "elasticPolicy", "nprocPerNode"}
    run_policy = {"backoffLimit", "cleanPodPolicy", "ttlSecondsAfterFinished", "activeDeadlineSeconds",
                  "schedulingPolicy", "suspend"}  # fmt: skip
    assert set(job["spec"]["runPolicy"]) <= run_policy
    assert isinstance(job["spec"]["runPolicy"]["backoffLimit"], int)
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert "Master" in replicas and set(replicas) <= {"Master", "Worker"}
    for replica in replicas.values():
        assert set(replica) == {"replicas", "restartPolicy", "template"}
        assert isinstance(replica["replicas"], int) and replica["replicas"] >= 1
        assert replica["restartPolicy"] in {"Always", "OnFailure", "Never", "ExitCode"}
        assert any(c["name"] == "pytorch" for c in replica["template"]["spec"]["containers"])
        _kubernetes_model("V1PodTemplateSpec", replica["template"])


def _kubernetes_model(name: str, obj: dict) -> None:
    """`obj` is a valid Kubernetes object of the model `name`: the client's models parse it (types, required
    fields), and nothing is lost on the way back (a misspelled field would be)."""
    import kubernetes.client as client

    model = getattr(client, name).from_dict(obj)
    assert client.ApiClient().sanitize_for_serialization(model) == obj


def test_the_objects_are_valid_kubernetes_objects(config_file):
    for pvc in (None, "runs"):
        _, docs = _objects(config_file, "indexed-job", pvc=pvc)
        for doc in docs:
            _kubernetes_model(f"V1{doc['kind']}", doc)
    _, (config_map, _) = _objects(config_file, "pytorchjob")
    _kubernetes_model("V1ConfigMap", config_map)
    # and the check can fail: a misspelled field, a missing required one
    _, (_, _, job) = _objects(config_file, "indexed-job")
    _container(job["spec"]["template"])["volumeMount"] = []
    with pytest.raises(AssertionError):
        _kubernetes_model("V1Job", job)
    del _container(job["spec"]["template"])["name"]
    with pytest.raises(Exception, match="name"):
        _kubernetes_model("V1Job", job)


def test_no_restarts_means_no_retries_and_no_pvc_is_a_warning(config_file):
    spec, docs = _objects(config_file, "indexed-job", restarts=0)
    job = docs[-1]
    assert job["spec"]["backoffLimit"] == 0 and job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    (warning,) = manifest_warnings(spec, K8sOptions())
    assert "no --pvc" in warning and "split over the pods" in warning
    assert manifest_warnings(spec, K8sOptions(pvc="runs")) == []
    cpu = _spec(config_file, ("hardware.device=cpu",))
    pod = manifest_objects(cpu, K8sOptions(), "x: 1\n")[-1]["spec"]["template"]
    assert "resources" not in _container(pod)  # no GPUs for a CPU job


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("Bad_Name", K8sOptions(), "--name 'Bad_Name': a Kubernetes name"),
        ("x" * 62, K8sOptions(), "at most 61"),
        ("ok", K8sOptions(kind="mpijob"), "--k8s-kind 'mpijob': expected one of indexed-job, pytorchjob"),
        ("ok", K8sOptions(pvc="Runs!"), "--pvc 'Runs!'"),
        ("ok", K8sOptions(namespace="ML"), "--namespace 'ML'"),
        ("ok", K8sOptions(image="a b"), "--image 'a b'"),
    ],
)
def test_bad_kubernetes_options_are_errors_naming_the_flag(config_file, name, options, message):
    with pytest.raises(ShardforgeError, match=message):
        render_manifest(_spec(config_file, name=name), options, "x: 1\n")
    with pytest.raises(ShardforgeError, match="too large for a ConfigMap"):
        render_manifest(_spec(config_file), K8sOptions(), "#" * (1 << 20))


# ---- the commands -----------------------------------------------------------------------------------------


def test_launch_writes_into_the_run_folder_and_flags_are_checked(config_file, tmp_path, capsys):
    assert cli.main(["launch", str(config_file), "--k8s", "--gpus-per-node", "2", "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    manifest = tmp_path / "run" / "shardforge-my-config.k8s.yaml"
    assert f"wrote {manifest}" in out and "kubectl apply -f" in out and "no --pvc" in out
    assert [d["kind"] for d in yaml.safe_load_all(manifest.read_text())] == ["ConfigMap", "Service", "Job"]
    cases = [
        (["--k8s", "--partition", "gpu"], "--partition: only with --slurm"),
        (["--slurm", "--pvc", "x", "--image", "y"], "--image, --pvc: only with --k8s"),
        (["--k8s", "--submit"], "--submit runs sbatch (with --slurm)"),
        (["--slurm", "train.lr=abc"], "train.lr = 'abc'"),
        (["--slurm", "--gpus-per-node", "1", "--time", "soon"], "--time 'soon'"),
    ]
    for flags, message in cases:
        out_file = tmp_path / "never.sbatch"
        assert cli.main(["launch", str(config_file), *flags, "--out", str(out_file)]) == 2, flags
        err = capsys.readouterr().err
        assert message in err.replace("\n", " ") and "Traceback" not in err, (flags, err)
        assert not out_file.exists()


def test_a_node_agent_is_never_a_rank_itself(config_file, monkeypatch, capsys):
    """Under srun with one task per node SLURM_NTASKS > 1: the agent must not take SLURM's task variables
    as its own rank; it starts its ranks through torch elastic with the rendezvous it was given."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_PROCID", "1")
    for key in ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "OMP_NUM_THREADS"):  # the agent sets them: undone after
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    # Without agent flags this is a task per rank, translated (and here missing MASTER_ADDR): the check bites.
    assert cli.main(["train", str(config_file)]) == 2
    assert "set MASTER_ADDR" in capsys.readouterr().err

    import torch.distributed.launcher.api as launcher

    seen = {}

    def fake_elastic_launch(config, entrypoint):
        seen["config"] = config
        return lambda *args: seen.setdefault("args", args)

    monkeypatch.setattr(launcher, "elastic_launch", fake_elastic_launch)
    flags = ["--nproc", "2", "--nnodes", "2", "--rdzv-endpoint", "node001:29511", "--rdzv-id", "4242"]
    assert cli.main(["train", str(config_file), "train.lr=1e-4", *flags, "--max-restarts", "3"]) == 0
    assert "RANK" not in os.environ
    config = seen["config"]
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 2, 2)
    assert (config.rdzv_endpoint, config.run_id, config.rdzv_backend) == ("node001:29511", "4242", "c10d")
    assert config.max_restarts == 3
    # Each rendezvous round's ranks get a store of their own: restart counts differ between agents.
    assert os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert seen["args"] == (
        "-m",
        "shardforge",
        "train",
        str(config_file),
        "train.lr=1e-4",
    )  # ranks: plain train

    for bad, message in [
        (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
        (["--nnodes", "2", "--rdzv-endpoint", "node001:29511"], "--nnodes 2 needs --rdzv-id"),
        (["--nnodes", "2", "--rdzv-endpoint", "node001", "--rdzv-id", "x"], "--rdzv-endpoint 'node001'"),
        (["--rdzv-endpoint", "node001:0"], "--rdzv-endpoint 'node001:0'"),
    ]:
        assert cli.main(["train", str(config_file), *bad]) == 2
        err = capsys.readouterr().err
        assert message in err and "MASTER_ADDR" not in err, (bad, err)


LLAMA_70B = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
             "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 5e5,
             "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "tie_word_embeddings": False}  # fmt: skip


def test_the_job_runs_the_preflight_before_anything_is_written(config_file, tmp_path, capsys):
    """The ranks' own preflight, run by `launch` first: degrees that do not multiply to the job's world, and
    a layout whose tensor parallel spans nodes *and* whose memory does not fit, both named at once; nothing
    written. A layout that runs is written, with what the preflight found."""
    out_file = tmp_path / "job.sbatch"
    launch = ["launch", str(config_file), "--slurm", "--out", str(out_file)]
    assert cli.main([*launch, "--nodes", "2", "--gpus-per-node", "3", "parallel.tp=4"]) == 2
    assert "degrees do not multiply to the world size" in capsys.readouterr().err.replace("\n", " ")
    (tmp_path / "70b").mkdir()
    (tmp_path / "70b" / "config.json").write_text(json.dumps(LLAMA_70B))
    big = [f"model.path={tmp_path / '70b'}", "model.preset=null", "hardware.preset=h100",
           "hardware.peak_flops=null", "parallel.tp=8", "data.max_length=4096"]  # fmt: skip
    assert cli.main([*launch, "--nodes", "2", "--gpus-per-node", "4", *big]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "tp=8 does not fit in a node of 4 devices; needs" in err and "GiB per device of 80.0" in err, err
    assert not out_file.exists()
    assert cli.main([*launch, "--nodes", "2", "--gpus-per-node", "2"]) == 0
    assert "preflight: " in capsys.readouterr().out and out_file.exists()
