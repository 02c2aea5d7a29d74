"""deploy/k8s on paper (no cluster here): every manifest against the published schemas, offline, and its
stop settings against the preemption code's; the tracking server's choice of PostgreSQL. SLURM runs for real in
test_slurm.py."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from ddpipe.config.load import load_config
from ddpipe.core.exits import EXIT_PREEMPTED
from tests.conftest import PARAMS, ROOT

K8S = ROOT / "deploy" / "k8s"
IMAGE_PYTHON = "/opt/ddpipe/venv/bin/python"  # the training image's own interpreter (Containerfile)
K8S_VERSION = "1.31"  # podFailurePolicy is GA from here: the oldest release checked; 1.37 (newest bundled) too
GRACE_MARGIN_S = 30   # for the step in progress and the process exits, beyond torchrun's own wait


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


@pytest.mark.parametrize("version", [K8S_VERSION, "1.37"])
@pytest.mark.parametrize("name", ["indexed-job.yaml", "pvc.yaml"])
def test_k8s_manifests_are_valid_for_the_kubernetes_api(name: str, version: str) -> None:
    """kubernetes-validate (the published OpenAPI schemas, bundled: no cluster, no network), strict:
    unknown fields are errors too."""
    import kubernetes_validate

    for doc in _docs(name):
        kubernetes_validate.validate(doc, version, strict=True)


def _check_value(item: object, annotation: object, where: str) -> None:
    """``item`` against its field's type: a model's keys (:func:`_check_fields`), through Optional, lists and maps."""
    import types
    import typing

    from pydantic import BaseModel

    origin, args = typing.get_origin(annotation), [a for a in typing.get_args(annotation) if a is not type(None)]
    if origin in (typing.Union, types.UnionType):
        assert len(args) == 1, f"{where}: a union of {args}"
        _check_value(item, args[0], where)
    elif origin is list and isinstance(item, list):
        for i, element in enumerate(item):
            _check_value(element, args[0], f"{where}[{i}]")
    elif origin is dict and isinstance(item, dict):
        for key, element in item.items():
            _check_value(element, args[1], f"{where}.{key}")
    elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
        _check_fields(item, annotation, where)


def _check_fields(value: object, model: type, where: str) -> None:
    """Every key of ``value`` is a field of the Kubeflow Trainer API's model ``model`` (generated from its OpenAPI
    spec, Kubernetes' own types included), recursively: the models themselves ignore unknown keys."""
    if not isinstance(value, dict):
        return
    fields = {info.alias or name: info for name, info in model.model_fields.items()}
    unknown = set(value) - set(fields)
    assert not unknown, f"{where}: {sorted(unknown)} are not fields of {model.__name__}"
    for key, item in value.items():
        _check_value(item, fields[key].annotation, f"{where}.{key}")


def _launch(command: list[str]) -> list[str]:
    """What a container runs: its command, or the command a ``/bin/sh -ec`` script ``exec``s after its set-up."""
    if command[:2] == ["/bin/sh", "-ec"]:
        return command[2].split("exec ", 1)[1].split()
    return command


@pytest.mark.parametrize("name", ["trainjob.yaml", "trainjob-object-store.yaml"])
def test_k8s_trainjob_has_only_fields_of_the_kubeflow_trainer_api_and_runs_the_image(name: str) -> None:
    """kubernetes-validate has no schema for Kubeflow Trainer's TrainJob: it is validated by the Trainer API's models
    (required fields, types) and its keys checked against them; it runs the image's own interpreter, never a path of
    the host that wrote it."""
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

    (job,) = _docs(name)
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert job["spec"]["runtimeRef"]["name"] == "torch-distributed"
    TrainerV1alpha1TrainJob.from_dict(job)
    _check_fields(job, TrainerV1alpha1TrainJob, "TrainJob")
    assert _launch(job["spec"]["trainer"]["command"])[0] == IMAGE_PYTHON and str(ROOT) not in yaml.safe_dump(job)


def test_the_no_shared_disk_trainjob_pulls_then_checkpoints_to_the_store_and_mounts_no_volume() -> None:
    """Each pod: DVC without git (the image has no .git), the prepared data pulled from the repository's default remote,
    then the launcher with its checkpoints in the bucket of that remote; the store's keys from a secret; no volume but
    /dev/shm."""
    (job,) = _docs("trainjob-object-store.yaml")
    script = job["spec"]["trainer"]["command"][2]
    assert script.index("core.no_scm true") < script.index("dvc pull prepare") < script.index("exec ")
    remote = re.search(r"url = (\S+)", (ROOT / ".dvc" / "config").read_text())[1]
    (checkpoints,) = [a for a in _launch(job["spec"]["trainer"]["command"]) if a.startswith("paths.checkpoints=")]
    assert checkpoints.split("=", 1)[1].split("/")[2] == remote.split("/")[2]  # the same bucket
    assert {e["name"] for e in job["spec"]["trainer"]["env"] if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]} \
        == {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    (node,) = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    volumes = node["template"]["spec"]["template"]["spec"]["volumes"]
    assert [v["name"] for v in volumes] == ["dshm"] and "persistentVolumeClaim" not in yaml.safe_dump(job)


def test_the_manifests_run_the_interpreter_the_containerfile_makes() -> None:
    containerfile = (ROOT / "Containerfile").read_text()
    assert f"UV_PROJECT_ENVIRONMENT={IMAGE_PYTHON.removesuffix('/bin/python')}" in containerfile


def _final_user(containerfile: str) -> str:
    """The USER the image runs as: the last one of the last stage, which must come after its last RUN (the installs
    run as root). Instructions are the lines that start with a word; continuations are indented."""
    words = [line.split(None, 1) for line in containerfile.splitlines() if re.match(r"[A-Z]+\s", line)]
    stage = words[max(i for i, w in enumerate(words) if w[0] == "FROM"):]
    users = [i for i, w in enumerate(stage) if w[0] == "USER"]
    assert users and users[-1] > max(i for i, w in enumerate(stage) if w[0] == "RUN"), "no USER after the last RUN"
    return stage[users[-1]][1].strip()


def _pods() -> dict[str, dict]:
    """Every pod spec of the Kubernetes manifests, by where it comes from: deploy/k8s's, and the Job that `ddpipe
    cluster submit` writes (:func:`kubernetes.manifests`, validated here against the API's schema too)."""
    import kubernetes_validate

    from ddpipe.launch.cluster import kubernetes

    pods = {"indexed-job.yaml": _docs("indexed-job.yaml")[1]["spec"]["template"]["spec"]}
    for name in ("trainjob.yaml", "trainjob-object-store.yaml"):
        (job,) = _docs(name)
        (node,) = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
        pods[name] = node["template"]["spec"]["template"]["spec"]
    cfg = load_config([f"cluster.image={_made_image()}"], params_file=PARAMS)  # no default: a submission names one
    (_, submitted) = kubernetes.manifests(cfg, "ddpipe-s-0", "s", "exp", "ddpipe-s", 0)
    kubernetes_validate.validate(submitted, K8S_VERSION, strict=True)
    pods["ddpipe cluster submit"] = submitted["spec"]["template"]["spec"]
    return pods


def test_the_image_and_every_pod_run_as_one_user_never_root() -> None:
    """The Containerfile ends as a numeric, non-zero USER (uid:gid) after every install, with a HOME of its own and
    the repository its own; every pod of the manifests says runAsNonRoot with that uid and group, and fsGroup, which
    makes the volume writable by it. (`podman run IMAGE id -u` prints it: tests/test_image.py.)"""
    from ddpipe.launch.cluster.kubernetes import IMAGE_UID

    containerfile = (ROOT / "Containerfile").read_text()
    uid, _, gid = _final_user(containerfile).partition(":")
    assert uid.isdigit() and int(uid) == IMAGE_UID != 0 and gid == uid, _final_user(containerfile)
    assert f"useradd --uid {IMAGE_UID} --gid {IMAGE_UID} --home-dir /home/ddpipe" in containerfile
    assert "ENV HOME=/home/ddpipe" in containerfile
    assert f"chown -R {IMAGE_UID}:{IMAGE_UID} /opt/ddpipe/repo" in containerfile
    for where, pod in _pods().items():
        assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": IMAGE_UID, "runAsGroup": IMAGE_UID,
                                          "fsGroup": IMAGE_UID, "fsGroupChangePolicy": "OnRootMismatch"}, where
        assert all("securityContext" not in c for c in pod["containers"]), where  # no container overrides it


def _made_image() -> str:
    """The name `make image` gives the training image (the Makefile's ``IMAGE ?=``)."""
    return re.search(r"^IMAGE \?= (\S+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)[1]


def test_no_manifest_names_an_image_that_nobody_built() -> None:
    """A made-up registry's name makes pods that can never pull their image. The manifests name the image `make image`
    builds (to load into a one-host cluster, or to replace with a registry's name, as their comments and
    docs/cluster.md say), with a pull policy that uses a loaded image where the API has one; `cluster.image` has no
    default, and the submission refuses to start without it (tests/test_cluster.py)."""
    made = _made_image()
    assert made == "localhost/ddpipe:latest"
    for path in sorted(K8S.glob("*.yaml")):
        text = path.read_text()
        assert "registry.example.com" not in text, path.name
        images = set(re.findall(r"^\s*image: (\S+)", text, flags=re.MULTILINE))
        assert images <= {made}, (path.name, images)
    (_, job) = _docs("indexed-job.yaml")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert (container["image"], container["imagePullPolicy"]) == (made, "IfNotPresent")
    assert load_config(params_file=PARAMS).cluster.image is None
    assert "registry.example.com" not in PARAMS.read_text()


def test_k8s_stop_settings_match_the_preemption_code() -> None:
    """The grace period covers torchrun's shutdown timeout; the Job treats exit 75 as "resume me"; the
    container runs ddpipe.launch (PID 1 is the only process the kubelet signals)."""
    shutdown = load_config(params_file=PARAMS).distributed.shutdown_timeout_s
    (_, job) = _docs("indexed-job.yaml")
    train_jobs = [_docs(name)[0] for name in ("trainjob.yaml", "trainjob-object-store.yaml")]
    nodes = [t["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
             for t in train_jobs]
    pods = [job["spec"]["template"]["spec"], *(node["template"]["spec"]["template"]["spec"] for node in nodes)]
    for pod in pods:
        assert pod["terminationGracePeriodSeconds"] >= shutdown + GRACE_MARGIN_S
    commands = (job["spec"]["template"]["spec"]["containers"][0]["command"],
                *(t["spec"]["trainer"]["command"] for t in train_jobs))
    for command in commands:
        assert _launch(command)[:3] == [IMAGE_PYTHON, "-m", "ddpipe.launch"]  # the image's interpreter (Containerfile)
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onExitCodes": {"containerName": "ddpipe", "operator": "In",
                                                "values": [EXIT_PREEMPTED]}} in rules
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"  # what podFailurePolicy requires


@pytest.mark.parametrize("name", ["train.sbatch", "train-object-store.sbatch"])
def test_slurm_script_requeues_on_the_preemption_exit_code_and_warns_ahead_of_the_limit(name: str) -> None:
    script = (ROOT / "deploy" / "slurm" / name).read_text()
    warn = re.search(r"^#SBATCH --signal=USR1@(\d+)", script, re.M)
    assert warn and int(warn[1]) >= load_config(params_file=PARAMS).distributed.shutdown_timeout_s + GRACE_MARGIN_S
    assert re.search(r"^#SBATCH --requeue\b", script, re.M)
    assert f'if [ "$status" -eq {EXIT_PREEMPTED} ]; then' in script and 'scontrol requeue "$SLURM_JOB_ID"' in script


def test_the_no_shared_disk_slurm_script_pulls_on_every_node_then_checkpoints_to_the_store() -> None:
    """Each node's own clone at the commit, the locked environment, `dvc pull prepare`, then the launcher run there
    with its checkpoints where CHECKPOINTS says; it refuses to start without them; valid bash."""
    script = (ROOT / "deploy" / "slurm" / "train-object-store.sbatch").read_text()
    for name in ("GIT_URL", "GIT_COMMIT", "CHECKPOINTS"):
        assert f': "${{{name}:?' in script
    assert script.index("make -s venv-runtime") < script.index("dvc pull prepare") < script.index("ddpipe.launch \\")
    assert 'paths.checkpoints="$CHECKPOINTS"' in script and '--chdir="$NODE_DIR"' in script
    assert "SLURM_SUBMIT_DIR" not in script  # nothing of the submitting host's disk
    subprocess.run(["bash", "-n", str(ROOT / "deploy" / "slurm" / "train-object-store.sbatch")], check=True)


def test_the_tracking_server_finds_any_postgresql_version_and_runs_a_data_directory_with_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Debian 12 ships PostgreSQL 15, Debian 13 17, Ubuntu 24.04 16, side by side in /usr/lib/postgresql/<major>/bin:
    a new data directory gets the newest; one made by an installed version gets that one; one made by a version not
    installed is refused, naming it, before anything starts."""
    from deploy import tracking_server
    from deploy.tracking_server import ServerError, pg_bin_dir

    for major in (15, 17, 16):
        (tmp_path / "lib" / str(major) / "bin").mkdir(parents=True)
        (tmp_path / "lib" / str(major) / "bin" / "initdb").write_text("")
    (tmp_path / "lib" / "common" / "bin").mkdir(parents=True)  # not a version
    monkeypatch.setattr(tracking_server, "PG_LIB", tmp_path / "lib")
    data = tmp_path / "data"
    data.mkdir()
    assert pg_bin_dir(data) == pg_bin_dir() == tmp_path / "lib" / "17" / "bin"
    (data / "PG_VERSION").write_text("15\n")
    assert pg_bin_dir(data) == tmp_path / "lib" / "15" / "bin"
    (data / "PG_VERSION").write_text("14\n")
    with pytest.raises(ServerError, match=r"made by PostgreSQL 14, which is not installed here \(installed: 15, 16"):
        pg_bin_dir(data)
