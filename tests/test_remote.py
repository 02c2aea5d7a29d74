"""The team's DVC remote on object storage (SeaweedFS's S3 API on 127.0.0.1, as `make remote` starts it): one clone
pushes what `dvc repro` made and an experiment; another, in another folder, pulls them instead of training; and a store
that is down, a wrong key or a missing bucket is named before anything is sent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import CLONE_ENV, GIT_ENV, ROOT, run

pytestmark = pytest.mark.slow

SCRIPT = str(ROOT / "deploy" / "object_store.py")


def _remote(repo: Path, store: Path) -> None:
    run(["python", SCRIPT, "dvc-remote", "--dir", str(store), "--repo", str(repo)], cwd=repo, env=CLONE_ENV)


def test_a_new_clone_pulls_what_another_pushed_and_trains_nothing(repro_clone: Path, store: Path,
                                                                  tmp_path: Path) -> None:
    assert "store" in (repro_clone / ".dvc" / "config").read_text()  # the remote the repository names, the default
    _remote(repro_clone, store)
    # where it is and its keys: in config.local only, which git ignores
    assert "127.0.0.1" not in (repro_clone / ".dvc" / "config").read_text()
    assert "127.0.0.1" in (repro_clone / ".dvc" / "config.local").read_text()
    run(["python", SCRIPT, "check"], cwd=repro_clone, env=CLONE_ENV)
    pushed = run(["dvc", "push"], cwd=repro_clone, env=CLONE_ENV).stdout
    assert "pushed" in pushed, pushed
    # an experiment too, through a git remote both clones know
    origin = tmp_path / "origin.git"
    run(["git", "init", "-q", "--bare", str(origin)], cwd=tmp_path, env=GIT_ENV)
    run(["git", "remote", "add", "origin", str(origin)], cwd=repro_clone, env=GIT_ENV)
    run(["git", "push", "-q", "origin", "HEAD:refs/heads/main"], cwd=repro_clone, env=GIT_ENV)

    other = tmp_path / "other"
    run(["git", "clone", "-q", "-b", "main", str(origin), str(other)], cwd=tmp_path, env=GIT_ENV)
    _remote(other, store)
    pulled = run(["dvc", "pull"], cwd=other, env=CLONE_ENV).stdout
    assert "Data and pipelines are up to date" in run(["dvc", "status"], cwd=other, env=CLONE_ENV).stdout, pulled
    again = run(["dvc", "repro"], cwd=other, env=CLONE_ENV).stdout
    assert "Running stage" not in again, again  # nothing trained, evaluated or exported again
    for metrics in ("metrics/test.json", "metrics/export.json"):
        assert json.loads((other / metrics).read_text()) == json.loads((repro_clone / metrics).read_text())
    assert (other / "models" / "model.pt").read_bytes() == (repro_clone / "models" / "model.pt").read_bytes()

    # an experiment: run and pushed from the first clone, pulled into the other with its outputs
    run(["dvc", "exp", "run", "-n", "pushed-exp", "-S", "seed=7", "-S", "num_epochs=1"], cwd=repro_clone,
        env=CLONE_ENV, timeout=900)
    run(["dvc", "exp", "push", "origin", "pushed-exp"], cwd=repro_clone, env=CLONE_ENV)

    run(["dvc", "exp", "pull", "origin", "pushed-exp"], cwd=other, env=CLONE_ENV)
    run(["dvc", "exp", "apply", "pushed-exp"], cwd=other, env=CLONE_ENV)  # its outputs came from the store
    assert "Data and pipelines are up to date" in run(["dvc", "status"], cwd=other, env=CLONE_ENV).stdout
    applied = json.loads((other / "metrics" / "train.json").read_text())
    assert applied == json.loads(run(["git", "show", "refs/exps/" + _exp_ref(repro_clone, "pushed-exp")
                                      + ":metrics/train.json"], cwd=repro_clone, env=GIT_ENV).stdout)


def _exp_ref(repo: Path, name: str) -> str:
    refs = run(["git", "for-each-ref", "--format=%(refname)", "refs/exps"], cwd=repo, env=GIT_ENV).stdout.split()
    (ref,) = [r for r in refs if r.endswith("/" + name)]
    return ref.removeprefix("refs/exps/")


def test_a_store_that_is_down_a_wrong_key_or_no_bucket_is_named_before_anything_is_sent(
        repro_clone: Path, store: Path, tmp_path: Path) -> None:
    from deploy.object_store import state

    _remote(repro_clone, store)

    def checked() -> str:
        said = run(["python", SCRIPT, "check"], cwd=repro_clone, env=CLONE_ENV, check=False)
        assert said.returncode == 2 and "Traceback" not in said.stderr, said.stderr
        return said.stderr

    run(["dvc", "remote", "modify", "--local", "store", "secret_access_key", "not-the-secret"], cwd=repro_clone)
    assert "DVC remote 'store' (s3://ddpipe/dvc" in (said := checked()) and "refused the credentials" in said, said
    _remote(repro_clone, store)
    run(["dvc", "remote", "modify", "store", "url", "s3://no-such-bucket/dvc"], cwd=repro_clone)
    assert "has no bucket 'no-such-bucket'" in checked()
    run(["dvc", "remote", "modify", "store", "url", "s3://ddpipe/dvc"], cwd=repro_clone)
    down = f"http://127.0.0.1:{state(store)['endpoint'].rsplit(':', 1)[1]}".replace("127.0.0.1", "127.0.0.2")
    run(["dvc", "remote", "modify", "--local", "store", "endpointurl", down], cwd=repro_clone)
    assert "the store does not answer" in checked()


def test_keys_go_into_config_local_off_the_command_line_even_a_secret_that_starts_with_a_dash(tmp_path: Path) -> None:
    """`dvc-remote` writes through DVC's config, not `dvc remote modify`: CI at c4db7ad drew a secret starting with
    "--", which DVC's command line took for an option (and its error printed the secret). A remote the repo lacks is
    named."""
    repo, store = tmp_path / "repo", tmp_path / "store"
    repo.mkdir()
    store.mkdir()
    run(["git", "init", "-q"], cwd=repo, env=GIT_ENV)
    run(["dvc", "init", "-q"], cwd=repo, env=CLONE_ENV)
    run(["dvc", "remote", "add", "-d", "store", "s3://bucket/path"], cwd=repo, env=CLONE_ENV)
    (store / "server.json").write_text(json.dumps({"endpoint": "http://127.0.0.1:9"}))
    (store / "credentials.json").write_text(json.dumps({"access_key_id": "ddpipe0", "secret_access_key": "--x-y"}))
    _remote(repo, store)
    local = (repo / ".dvc" / "config.local").read_text()
    assert "secret_access_key = --x-y" in local and "endpointurl = http://127.0.0.1:9" in local, local
    assert "--x-y" not in (repo / ".dvc" / "config").read_text()
    wrong = run(["python", SCRIPT, "dvc-remote", "--dir", str(store), "--repo", str(repo), "--remote", "nope"],
                cwd=repo, env=CLONE_ENV, check=False)
    assert wrong.returncode == 2 and "no DVC remote 'nope'" in wrong.stderr, wrong.stderr
    assert "--x-y" not in wrong.stdout + wrong.stderr
