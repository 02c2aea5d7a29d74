"""Kubernetes: an Indexed Job per queued experiment (N pods for N nodes) and a headless Service that names its pods,
as deploy/k8s/indexed-job.yaml does for one training. Pod 0 runs the experiment's driver (``dvc exp run`` in its
workspace); the other pods wait for that workspace and run one launcher each, joining pod 0's rendezvous. Every pod
runs the training image (``cluster.image``, the Containerfile's) with its own interpreter (:data:`IMAGE_PYTHON`), never
the submitting machine's; the repository and its DVC cache are on a PersistentVolumeClaim (``cluster.volume_claim``)
mounted at the same path as here, so the manifests name the same files as the submitting machine.

Written and validated offline (the tests check them against the Kubernetes API's schemas); not run on a cluster
here. ``submit --dry-run DIR`` writes them without kubectl.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

from ddpipe.config.schema import Config
from ddpipe.core.environment import K8S_JOB_ENV
from ddpipe.core.exits import EXIT_PREEMPTED, STOP_SIGNALS
from ddpipe.launch.cluster import ClusterError
from ddpipe.launch.torchrun import RDZV_PORT

FORWARD = STOP_SIGNALS  # the kubelet signals PID 1 only: the driver passes stops on
PORT = RDZV_PORT
WARN_SECONDS = 180  # no time-limit warning here; a SIGUSR1 sent by hand gets what SLURM's gets
# The training image's interpreter: the Containerfile's venv (UV_PROJECT_ENVIRONMENT), holding the lock's packages
IMAGE_PYTHON = "/opt/ddpipe/venv/bin/python"
GRACE_SECONDS = 120  # SIGTERM then SIGKILL: the step in progress plus a checkpoint (deploy/k8s/indexed-job.yaml)


def available() -> None:
    if not shutil.which("kubectl"):
        raise ClusterError("cluster.scheduler = 'kubernetes': kubectl is not on PATH; `ddpipe cluster submit "
                           "--dry-run DIR` writes the manifests without it")


def job_name(submission: str, index: int) -> str:
    return re.sub(r"[^a-z0-9-]", "-", f"ddpipe-{submission}-{index}".lower())[:63]


def rendezvous(job: str) -> str:
    return f"{job}-0.{job}:{PORT}"


def manifests(cfg: Config, job: str, submission: str, name: str, manifest: Path, index: int, repo: Path) -> list[dict]:
    """The Service and the Indexed Job of experiment ``name`` (``index`` in ``manifest``)."""
    c, nodes = cfg.cluster, int(cfg.distributed.nnodes)
    labels = {"app.kubernetes.io/name": "ddpipe", "ddpipe.cluster/submission": submission}
    resources: dict = {}
    if c.cpus_per_node:
        resources.setdefault("requests", {})["cpu"] = str(c.cpus_per_node)
    if c.mem:
        resources.setdefault("requests", {})["memory"] = c.mem
    if c.gpus_per_node:
        resources["limits"] = {"nvidia.com/gpu": c.gpus_per_node}
    container = {
        "name": "ddpipe", "image": c.image, "workingDir": str(repo),
        "command": [IMAGE_PYTHON, "-m", "ddpipe.launch.cluster.job", str(manifest), str(index)],
        "env": [{"name": K8S_JOB_ENV, "value": job}],
        "ports": [{"name": "rdzv", "containerPort": PORT}],
        "volumeMounts": [{"name": "workspace", "mountPath": str(repo)}],
    }
    if resources:
        container["resources"] = resources
    service = {"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": job, "namespace": c.namespace, "labels": labels},
               "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {"job-name": job},
                        "ports": [{"name": "rdzv", "port": PORT}]}}
    batch = {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": job, "namespace": c.namespace, "labels": labels,
                     "annotations": {"ddpipe.cluster/experiment": name}},
        "spec": {
            "completionMode": "Indexed", "completions": nodes, "parallelism": nodes, "backoffLimit": 4,
            "podFailurePolicy": {"rules": [
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                {"action": "Ignore",
                 "onExitCodes": {"containerName": "ddpipe", "operator": "In", "values": [EXIT_PREEMPTED]}},
            ]},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"subdomain": job, "restartPolicy": "Never", "terminationGracePeriodSeconds": GRACE_SECONDS,
                         "containers": [container],
                         "volumes": [{"name": "workspace",
                                      "persistentVolumeClaim": {"claimName": c.volume_claim}}]},
            },
        },
    }
    return [service, batch]


def submit(path: Path, namespace: str) -> None:
    out = subprocess.run(["kubectl", "apply", "-n", namespace, "-f", str(path)], capture_output=True, text=True,
                         timeout=120)
    if out.returncode != 0:
        raise ClusterError(f"kubectl apply -f {path} exited {out.returncode}: {out.stderr.strip()}")


def states(jobs: list[str]) -> dict[str, str]:
    """Each job's state; ``jobs`` as ``namespace/name``."""
    found = {}
    for job in jobs:
        namespace, _, name = job.rpartition("/")
        out = subprocess.run(["kubectl", "get", "job", name, "-n", namespace or "default", "-o", "json"],
                             capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            found[job] = "ENDED"
            continue
        conditions = {c["type"]: c["status"] for c in json.loads(out.stdout).get("status", {}).get("conditions", [])}
        found[job] = ("COMPLETED" if conditions.get("Complete") == "True" else
                      "FAILED" if conditions.get("Failed") == "True" else "RUNNING")
    return found


def cancel(jobs: list[str]) -> None:
    for job in jobs:
        namespace, _, name = job.rpartition("/")
        out = subprocess.run(["kubectl", "delete", "job", name, "-n", namespace or "default", "--wait=false"],
                             capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise ClusterError(f"kubectl delete job {name} exited {out.returncode}: {out.stderr.strip()}")


def job_id() -> str:
    return os.environ.get(K8S_JOB_ENV, "")


def attempt() -> int:
    return 0  # the Job controller does not tell a pod how many ran before it


def nodes_env(nnodes: int, workspace: Path) -> str:
    """Pod 0's launcher joins the rendezvous it hosts; the Job's other pods start their own (no launcher)."""
    return f"{rendezvous(job_id())} {job_id()}"
