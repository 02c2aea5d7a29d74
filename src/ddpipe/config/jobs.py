"""The schema's ``cluster`` section: how ``ddpipe cluster submit`` turns DVC's queued experiments into a
scheduler's jobs (docs/cluster.md). No stage reads it."""

# No ``from __future__ import annotations``: OmegaConf.structured reads the field types at runtime (as in schema.py).
from dataclasses import dataclass
from typing import Optional

from ddpipe.config.param import param


@dataclass
class ClusterConfig:
    """How ``ddpipe cluster submit`` sends DVC's queue to a scheduler (docs/cluster.md, "DVC's queue on a
    cluster").
    No stage reads it: the submit command reads it from each queued experiment's own params, so one experiment
    may ask for more than another."""

    scheduler: str = param("slurm", "Where queued experiments run: slurm (sbatch) or kubernetes (an Indexed Job "
                           "per experiment, kubectl).", choices=("slurm", "kubernetes"))
    partition: Optional[str] = param(None, "SLURM partition (--partition); null: the cluster's default.")
    account: Optional[str] = param(None, "SLURM account (--account); null: the user's default.")
    time_limit: str = param(
        "04:00:00", "Wall-clock limit of each run of a job ([D-]HH:MM:SS or minutes); a requeued run gets it anew, "
        "and 3 minutes before it the training checkpoints its step and the job requeues itself.",
        words="[D-]HH:MM:SS, MM:SS or minutes")
    gpus_per_node: int = param(0, "GPUs each node of a job asks for (0: a CPU job); distributed.nproc_per_node: "
                               "auto starts one process per GPU.", ge=0)
    cpus_per_node: Optional[int] = param(
        None, "CPU cores each node of a job asks for; null: whole nodes (--exclusive).", ge=1)
    mem: Optional[str] = param(None, "Memory per node (--mem, e.g. 64G); null: the partition's default.")
    max_running: Optional[int] = param(
        None, "At most this many experiments of one job array run at once (SLURM's %N; experiments that ask for the "
        "same resources are one array); null: no bound.", ge=1)
    storage: str = param(
        "shared", "shared: the jobs' workspaces and the DVC cache on a filesystem every node and this repository "
        "share; remote: nodes share nothing, each job clones from cluster.git_remote, pulls its data from the DVC "
        "remote and pushes its experiment back to both.", choices=("shared", "remote"))
    workdir: Optional[str] = param(
        None, "Where each job's workspace is made; null: <repo>/.dvc/tmp/cluster/work (shared), /tmp/ddpipe-cluster "
        "on the node (remote).")
    git_remote: str = param("origin", "storage: remote: the git remote (name or URL) the jobs clone from and push "
                            "their experiments to.")
    dvc_remote: Optional[str] = param(None, "storage: remote: the DVC remote for data and outputs; null: the "
                                      "repository's default remote.")
    image: Optional[str] = param(
        None, "kubernetes: the training image the pods run (the Containerfile's: `make image IMAGE=<registry>/"
        "ddpipe:<tag>`, pushed where every node pulls from); null: none, and `ddpipe cluster submit` for Kubernetes "
        "refuses to start until it is set.")
    namespace: str = param("default", "kubernetes: the namespace of the Jobs.")
    volume_claim: str = param("ddpipe-workspace", "kubernetes: the PersistentVolumeClaim holding the repository, "
                              "its venv and DVC cache (deploy/k8s/pvc.yaml), mounted at the repository's path.")
