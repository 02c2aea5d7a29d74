"""deploy/k8s on paper (no cluster here): every manifest against the published schemas, offline, and its
stop settings against the preemption code's; the tracking server's choice of PostgreSQL. SLURM runs for real in
test_slurm.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from ddpipe.config.load import load_config
from ddpipe.core.exits import EXIT_PREEMPTED
from tests.conftest import PARAMS, ROOT

K8S = ROOT / "deploy" / "k8s"
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


def _check_fields(value: object, model: type, where: str) -> None:
    """Every key of ``value`` is a field of the Kubeflow SDK model ``model`` (generated from the
    training operator's OpenAPI spec), recursively down to Kubernetes' own types."""
    import kubeflow.training.models as kf

    if not isinstance(value, dict):
        return
    fields = {json_key: attr for attr, json_key in model.attribute_map.items()}
    unknown = set(value) - set(fields)
    assert not unknown, f"{where}: {sorted(unknown)} are not fields of {model.__name__}"
    for key, item in value.items():
        kind = model.openapi_types[fields[key]]
        if m := re.fullmatch(r"dict\(str, (\w+)\)", kind):
            for k, v in item.items():
                _check_fields(v, getattr(kf, m[1]), f"{where}.{key}.{k}")
        elif hasattr(kf, kind):
            _check_fields(item, getattr(kf, kind), f"{where}.{key}")


def test_k8s_pytorchjob_has_only_fields_of_the_kubeflow_api_and_valid_pod_templates() -> None:
    """kubernetes-validate has no schema for the PyTorchJob custom resource: its fields are checked
    against the Kubeflow training SDK's models, and each replica's pod template against Kubernetes'
    PodTemplate schema."""
    import kubernetes_validate
    from kubeflow.training.models import KubeflowOrgV1PyTorchJob

    (job,) = _docs("pytorchjob.yaml")
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    _check_fields(job, KubeflowOrgV1PyTorchJob, "PyTorchJob")
    for role, spec in job["spec"]["pytorchReplicaSpecs"].items():
        assert spec["restartPolicy"] in ("Always", "OnFailure", "Never", "ExitCode"), role
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"ddpipe-{role.lower()}"},
                        "template": spec["template"]}
        for version in (K8S_VERSION, "1.37"):
            kubernetes_validate.validate(pod_template, version, strict=True)


def test_k8s_stop_settings_match_the_preemption_code() -> None:
    """The grace period covers torchrun's shutdown timeout; the Job treats exit 75 as "resume me"; the
    container runs ddpipe.launch (PID 1 is the only process the kubelet signals)."""
    shutdown = load_config(params_file=PARAMS).distributed.shutdown_timeout_s
    (_, job) = _docs("indexed-job.yaml")
    (torch_job,) = _docs("pytorchjob.yaml")
    pods = [job["spec"]["template"]["spec"],
            *(s["template"]["spec"] for s in torch_job["spec"]["pytorchReplicaSpecs"].values())]
    for pod in pods:
        assert pod["terminationGracePeriodSeconds"] >= shutdown + GRACE_MARGIN_S
        assert pod["containers"][0]["command"][:3] == ["python", "-m", "ddpipe.launch"]
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onExitCodes": {"containerName": "ddpipe", "operator": "In",
                                                "values": [EXIT_PREEMPTED]}} in rules
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"  # what podFailurePolicy requires


def test_slurm_script_requeues_on_the_preemption_exit_code_and_warns_ahead_of_the_limit() -> None:
    script = (ROOT / "deploy" / "slurm" / "train.sbatch").read_text()
    warn = re.search(r"^#SBATCH --signal=USR1@(\d+)", script, re.M)
    assert warn and int(warn[1]) >= load_config(params_file=PARAMS).distributed.shutdown_timeout_s + GRACE_MARGIN_S
    assert re.search(r"^#SBATCH --requeue\b", script, re.M)
    assert f'if [ "$status" -eq {EXIT_PREEMPTED} ]; then' in script and 'scontrol requeue "$SLURM_JOB_ID"' in script


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
