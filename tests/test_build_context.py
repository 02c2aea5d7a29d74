"""What an image's build is sent (its context) as podman and docker read it: `.containerignore`, the one list, and
`.dockerignore`, its byte-for-byte copy. A copy of the repository with a DVC remote's keys, credentials and
environment files, a tracking server's and an object store's folders, caches, runs and weights planted in it is built
into a tiny image (FROM scratch, the whole context copied: no registry, no base), once through each file: the image
holds none of them and no byte of the key, and every other file of the repository. Seconds; where podman cannot run
it skips, saying why."""

from __future__ import annotations

import secrets
import subprocess
import tarfile
from pathlib import Path

import pytest

from tests.conftest import ROOT, clone_repo, podman, podman_unavailable

KEY = f"ddpipe-planted-{secrets.token_hex(12)}"
# What a developer's checkout may hold and no image may: each file holds KEY
PLANTED = {
    ".dvc/config.local": f"['remote \"store\"']\n    access_key_id = {KEY}\n    secret_access_key = {KEY}\n",
    ".env": f"AWS_SECRET_ACCESS_KEY={KEY}\n",
    ".env.team": f"MLFLOW_TRACKING_PASSWORD={KEY}\n",
    "deploy/mlflow.env": f"MLFLOW_AUTH_ADMIN_PASSWORD={KEY}\n",  # docs/tracking.md's systemd EnvironmentFile
    "src/ddpipe/.env": f"TOKEN={KEY}\n",
    "admin-password": f"{KEY}\n",  # tracking_server.py --admin-password-file
    ".aws/credentials": f"[default]\naws_secret_access_key = {KEY}\n",
    ".mlflow/credentials": f"[mlflow]\nmlflow_tracking_password = {KEY}\n",
    "credentials.json": f'{{"key": "{KEY}"}}\n',
    ".netrc": f"machine mlflow.internal login alice password {KEY}\n",
    ".pgpass": f"127.0.0.1:5433:search:search:{KEY}\n",
    "deploy/tls/server.pem": KEY, "deploy/tls/server.key": KEY,
    "tracking-server/secrets/basic_auth.ini": KEY,
    "deploy/server/secrets/postgres-mlflow-password": KEY,  # a tracking server --dir elsewhere in the repository
    ".object-store/credentials.json": KEY,
    ".venv/pyvenv.cfg": KEY, ".dvc/cache/files/md5/ab/cdef": KEY, ".dvc/tmp/exps/run": KEY,
    "src/ddpipe/__pycache__/x.cpython-311.pyc": KEY, ".pytest_cache/v": KEY, ".ruff_cache/v": KEY,
    "mlflow.db": KEY, "mlflow.db-wal": KEY, "mlruns/0/meta.yaml": KEY, "mlartifacts/1/model.pt": KEY,
    "mlflow-outbox/run.jsonl": KEY, "checkpoints/ckpt-e0001.pt": KEY, "models/model.pt": KEY,
    "models/model.onnx": KEY, "pretrained/resnet50-11ad3fa6.pth": KEY, "data/raw/train.gz": KEY,
    "data/prepared/train.bin": KEY,
}
# The repository's own files that stay out: the evaluate stage's reports (images a build does not need)
LEFT_OUT = ("reports/",)


def test_dockerignore_is_a_byte_for_byte_copy_of_containerignore() -> None:
    """docker reads .dockerignore, podman .containerignore first: one list, kept in two files."""
    source, copy = (ROOT / ".containerignore").read_bytes(), (ROOT / ".dockerignore").read_bytes()
    assert copy == source, ".dockerignore differs from .containerignore, its source: cp .containerignore .dockerignore"
    assert not (ROOT / ".dockerignore").is_symlink()


def test_git_ignores_the_secrets_a_checkout_may_hold() -> None:
    names = [".dvc/config.local", ".env", ".env.team", "deploy/mlflow.env", "src/ddpipe/.env"]
    said = subprocess.run(["git", "check-ignore", *names], cwd=ROOT, capture_output=True, text=True)
    assert said.stdout.split() == names, said.stdout + said.stderr


def _context_of_image(context: Path, containerfile: Path, tag: str) -> dict[str, bytes]:
    """The files (path under the context: content) that an image built from ``context`` copies: every one of them."""
    podman("build", "-q", "--network", "none", "--pull=never", "-f", str(containerfile), "-t", tag, str(context),
           timeout=300)
    container = podman("create", tag, "none").stdout.strip()
    try:
        exported = containerfile.with_suffix(".tar")
        podman("export", "-o", str(exported), container, timeout=300)
        with tarfile.open(exported) as tar:
            return {m.name.removeprefix("ctx/"): tar.extractfile(m).read() for m in tar.getmembers()
                    if m.isfile() and m.name.startswith("ctx/")}
    finally:
        podman("rm", "-f", container, check=False)
        podman("rmi", "-f", tag, check=False)


@pytest.mark.parametrize("ignore_file", [".containerignore", ".dockerignore"])
def test_an_image_built_from_a_checkout_holding_keys_holds_none_of_them(tmp_path: Path, ignore_file: str) -> None:
    """The copy's files as a fresh clone has them, a git directory, and :data:`PLANTED`; with ``ignore_file`` alone
    (podman reads .dockerignore, as docker does, where there is no .containerignore)."""
    if why := podman_unavailable():
        pytest.skip(why)
    repo = clone_repo(tmp_path / "repo")
    tracked = subprocess.run(["git", "ls-files"], cwd=repo, capture_output=True, text=True, check=True).stdout.split()
    for name, text in PLANTED.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    (repo / {".containerignore": ".dockerignore", ".dockerignore": ".containerignore"}[ignore_file]).unlink()
    probe = tmp_path / "Probe.containerfile"  # outside the context, as -f may be
    probe.write_text("FROM scratch\nCOPY . /ctx\n")
    files = _context_of_image(repo, probe, f"localhost/ddpipe-context-probe:{tmp_path.name.lower()}")

    assert "params.yaml" in files and "src/ddpipe/__init__.py" in files, sorted(files)[:20]
    assert not [name for name in files if name.startswith(".git/")]
    planted = [name for name in PLANTED if name in files]
    assert not planted, f"{ignore_file} lets these into the image: {planted}"
    holding = [name for name, data in files.items() if KEY.encode() in data]
    assert not holding, f"these files in the image hold the planted key: {holding}"
    missing = {name for name in tracked if not name.startswith(LEFT_OUT)} - set(files) - {".containerignore",
                                                                                         ".dockerignore"}
    assert not missing, f"{ignore_file} leaves out files of the repository: {sorted(missing)}"
