"""Kubernetes: an Indexed Job per queued experiment (N pods for N nodes) and a headless Service that names its pods,
as deploy/k8s/indexed-job.yaml does for one training. Pod 0 runs the experiment's driver (``dvc exp run`` in its
workspace); the other pods wait for that workspace and run one launcher each, joining pod 0's rendezvous. Every pod
runs the training image (``cluster.image``, the Containerfile's) with its own interpreter (:data:`IMAGE_PYTHON`), never
the submitting machine's, as its user (:data:`IMAGE_UID`), never root. The repository, at the root of a
PersistentVolumeClaim (``cluster.volume_claim``), is mounted at :data:`POD_REPO`, and what a job reads (the group's
manifest, every path in it rebased there: :func:`in_pods`) comes in a ConfigMap of the same YAML: the manifests name
no path of the submitting machine.

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
from ddpipe.launch.cluster import RDZV_PORT, ClusterError

FORWARD = STOP_SIGNALS  # the kubelet signals PID 1 only: the driver passes stops on
PORT = RDZV_PORT
WARN_SECONDS = 180  # no time-limit warning here; a SIGUSR1 sent by hand gets what SLURM's gets
# The training image's interpreter: the Containerfile's venv (UV_PROJECT_ENVIRONMENT), holding the lock's packages
IMAGE_PYTHON = "/opt/ddpipe/venv/bin/python"
# The training image's user (the Containerfile's USER, uid and gid), never root: the pods run as it, and fsGroup gives
# it the repository's volume, where the volume's driver manages ownership (on NFS the files must be writable by it)
IMAGE_UID = 10001
POD_REPO = "/workspace"  # where the pods mount the volume that holds the repository at its root
POD_CONFIG = "/etc/ddpipe"  # where the pods mount the group's ConfigMap: its manifest, group.json
GRACE_SECONDS = 120  # SIGTERM then SIGKILL: the step in progress plus a checkpoint (deploy/k8s/indexed-job.yaml)


def available() -> None:
    if not shutil.which("kubectl"):
        raise ClusterError("cluster.scheduler = 'kubernetes': kubectl is not on PATH; `ddpipe cluster submit "
                           "--dry-run DIR` writes the manifests without it")


def require_image(image: str | None, experiment: str) -> str:
    """``cluster.image``, which has no default: a name that no node can pull makes pods that wait for ever
    (ErrImagePull), so an unset one is refused before anything is submitted."""
    if not image:
        raise ClusterError(
            f"queued experiment {experiment!r}: cluster.image is not set, and the pods need the training image by a "
            "name their nodes can pull: build it with `make image IMAGE=<registry>/ddpipe:<tag>`, push it "
            "(podman push <registry>/ddpipe:<tag>), then set cluster.image in params.yaml or on the command line "
            "(ddpipe cluster submit cluster.image=<registry>/ddpipe:<tag>); docs/cluster.md, \"Kubernetes\"")
    return image


def job_name(submission: str, index: int) -> str:
    return re.sub(r"[^a-z0-9-]", "-", f"ddpipe-{submission}-{index}".lower())[:63]


def rendezvous(job: str) -> str:
    return f"{job}-0.{job}:{PORT}"


def in_pods(m: dict, repo: Path) -> dict:
    """A group's manifest as its pods read it: every path of the repository's (its state, its DVC cache, the
    experiments' workspaces and logs) rebased to :data:`POD_REPO`, the interpreter the image's. A path the volume does
    not hold (a DVC cache or ``cluster.workdir`` outside the repository) is refused, naming it; a workspace on the
    node's own disk (``storage: remote``, /tmp/ddpipe-cluster) stays as it is."""
    root = Path(repo).resolve()

    def rebased(path: str, what: str, local_ok: bool = False) -> str:
        p = Path(path).resolve()
        if p == root or root in p.parents:
            return str(Path(POD_REPO) / p.relative_to(root))
        if local_ok:
            return path
        raise ClusterError(f"{what} = {path} is outside the repository {root}: on Kubernetes the pods see the "
                           f"repository's volume only (mounted at {POD_REPO}); keep it inside the repository")

    def store(uri: str) -> str:  # a sqlite store in the repository (the default): the pods' path to the same file
        return "sqlite:///" + rebased(uri.removeprefix("sqlite:///"), "mlflow.tracking_uri", True) \
            if uri.startswith("sqlite:///") else uri

    remote = lambda e: e["storage"] == "remote"  # noqa: E731
    return {**m, "repo": POD_REPO, "python": IMAGE_PYTHON, "state": rebased(m["state"], "the cluster state"),
            "cache": rebased(m["cache"], "the DVC cache (dvc cache dir)"),
            "experiments": [{**e, "workspace": rebased(e["workspace"], "cluster.workdir", remote(e)),
                             "log": rebased(e["log"], "the job's log", remote(e)),
                             "tracking_uri": store(e["tracking_uri"])} for e in m["experiments"]]}


def config_map(name: str, namespace: str, manifest: dict) -> dict:
    """The ConfigMap that brings a group's manifest (:func:`in_pods`) to its pods, as ``group.json``."""
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": namespace},
            "data": {"group.json": json.dumps(manifest, indent=1)}}


def pod_security() -> dict:
    """A pod's securityContext: the image's user (:data:`IMAGE_UID`), never root, its group the volume's files'."""
    return {"runAsNonRoot": True, "runAsUser": IMAGE_UID, "runAsGroup": IMAGE_UID, "fsGroup": IMAGE_UID,
            "fsGroupChangePolicy": "OnRootMismatch"}  # a volume's files regrouped only when its root is not


def manifests(cfg: Config, job: str, submission: str, name: str, config: str, index: int) -> list[dict]:
    """The Service and the Indexed Job of experiment ``name`` (``index`` in the manifest of ConfigMap ``config``)."""
    c, nodes = cfg.cluster, int(cfg.distributed.nnodes)
    assert c.image, "cluster.image is checked before any manifest is written (require_image)"
    labels = {"app.kubernetes.io/name": "ddpipe", "ddpipe.cluster/submission": submission}
    resources: dict = {}
    if c.cpus_per_node:
        resources.setdefault("requests", {})["cpu"] = str(c.cpus_per_node)
    if c.mem:
        resources.setdefault("requests", {})["memory"] = c.mem
    if c.gpus_per_node:
        resources["limits"] = {"nvidia.com/gpu": c.gpus_per_node}
    container = {
        "name": "ddpipe", "image": c.image, "workingDir": POD_REPO,
        "command": [IMAGE_PYTHON, "-m", "ddpipe.launch.cluster.job", f"{POD_CONFIG}/group.json", str(index)],
        "env": [{"name": K8S_JOB_ENV, "value": job}],
        "ports": [{"name": "rdzv", "containerPort": PORT}],
        "volumeMounts": [{"name": "workspace", "mountPath": POD_REPO},
                         {"name": "manifest", "mountPath": POD_CONFIG, "readOnly": True}],
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
                         "securityContext": pod_security(), "containers": [container],
                         "volumes": [{"name": "workspace", "persistentVolumeClaim": {"claimName": c.volume_claim}},
                                     {"name": "manifest", "configMap": {"name": config}}]},
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
