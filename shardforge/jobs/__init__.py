"""Multi-node job files: a SLURM batch script or a Kubernetes manifest that starts one `shardforge train`
agent per node (`shardforge launch`). Rendering only: the CLI builds the JobSpec and writes the files."""

from shardforge.jobs.k8s import K8sOptions, render_manifest
from shardforge.jobs.slurm import SlurmOptions, render_sbatch
from shardforge.jobs.spec import JobSpec, job_spec

__all__ = ["JobSpec", "K8sOptions", "SlurmOptions", "job_spec", "render_manifest", "render_sbatch"]
