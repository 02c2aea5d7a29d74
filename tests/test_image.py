"""The training image (Containerfile), built with podman from a Debian base that debootstrap makes (no registry is
reachable here), run as a 2-node job of two containers: each container one node, a c10d rendezvous between them.
SIGTERMed mid-epoch, both exit 75; started again, they resume and end bit-equal to an uninterrupted run of this venv.
The image runs as its own user (uid 10001), never root. What its build is sent: tests/test_build_context.py (seconds).

Minutes (the base, the build, three trainings): `make test-image` runs it, `make test` leaves it out (marker image).
Where podman cannot run it skips, saying why."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ddpipe.core.exits import EXIT_PREEMPTED
from ddpipe.launch.cluster.kubernetes import IMAGE_UID
from tests.conftest import (
    CLONE_ENV,
    CONTAINERS_CONF,
    ROOT,
    STOPPED,
    args_for,
    free_port,
    podman,
    podman_unavailable,
    run,
    same_weights,
    wait_for_step_checkpoint,
    weights,
)

pytestmark = [pytest.mark.slow, pytest.mark.image]

BASE, IMAGE = "localhost/ddpipe-base:bookworm", "localhost/ddpipe:test"
# The image's own interpreter (Containerfile), never a path of this host
PYTHON = "/opt/ddpipe/venv/bin/python"
# a world of 2 (one process per node), 3 epochs, a checkpoint every 2 steps so that the stop lands inside epoch 2
TRAINING = ("num_epochs=3", "train.batch_size_per_rank=16", "distributed.threads_per_process=1",
            "train.checkpoint_every_steps=2")


@pytest.fixture(scope="module")
def image() -> str:
    """The image, built by `make image` from the debootstrap base (`make image-base`), once per run."""
    if why := podman_unavailable("debootstrap"):
        pytest.skip(why)
    run(["make", "image-base"], cwd=ROOT, timeout=1800)
    run(["make", "image", f"IMAGE={IMAGE}", f"IMAGE_BASE={BASE}"], cwd=ROOT, timeout=1800)
    return IMAGE


def node(image: str, name: str, mounts: list[Path], args: list[str], names: list[str]) -> subprocess.Popen:
    """One node of the job: a container of ``image`` on the host's network running ddpipe's launcher under an init
    that passes signals on, with ``mounts`` at their own paths (made its user's: the image does not run as root). A
    hostname of its own, as a node has: the c10d rendezvous tells its agents apart by hostname and pid, and in their
    own pid namespaces both agents are pid 9; and every node's name resolves to an address of its own (``names``:
    127.0.0.2, 127.0.0.3, ..., this host's loopback), as a cluster's DNS makes them: the node that hosts rank 0 gives
    its hostname as the workers' master address, and an agent names itself by the host its hostname's address
    resolves back to."""
    volumes = [arg for m in mounts for arg in ("-v", f"{m}:{m}:U")]
    hosts = [arg for i, other in enumerate(names) for arg in ("--add-host", f"{other}:127.0.0.{i + 2}")]
    cmd = ["podman", "run", "--name", name, "--hostname", name, *hosts, "--init", "--network", "host", *volumes, image,
           PYTHON, "-m", "ddpipe.launch", *args]
    return subprocess.Popen(cmd, env={**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def two_nodes(image: str, tmp: Path, prepared: Path, run_id: str) -> list[subprocess.Popen]:
    port = free_port()
    args = args_for(tmp, prepared, *TRAINING, "distributed.nproc_per_node=1", "distributed.nnodes=2",
                    f"distributed.rdzv_endpoint=127.0.0.1:{port}", f"distributed.rdzv_id={run_id}")
    names = [f"{run_id}-{i}" for i in range(2)]
    for name in names:
        podman("rm", "-f", name, check=False)
    return [node(image, name, [tmp, prepared], args, names) for name in names]


def test_the_image_holds_the_lock_and_names_no_host_path(image: str) -> None:
    said = podman("run", "--rm", image, PYTHON, "-c",
                  "import sys, ddpipe; from ddpipe.core.lockfile import environment_tags; "
                  "print(sys.executable, ddpipe.__file__, environment_tags()['ddpipe.env_matches_lock'])").stdout
    interpreter, package, matches = said.split()
    assert interpreter == PYTHON and package.startswith("/opt/ddpipe/venv/") and matches == "true", said
    config = podman("image", "inspect", image, "--format", "{{.Config.Env}} {{.Config.WorkingDir}}").stdout
    assert str(ROOT) not in config and sys.prefix not in config, config


def test_the_image_runs_as_its_own_user_who_owns_the_repository_and_home(image: str) -> None:
    """Not root: the Containerfile's uid (the one the Kubernetes manifests name), writing where DVC and the stages
    write (the repository) and in its HOME; the environment is root's, read-only to it."""
    said = podman("run", "--rm", image, "sh", "-c",
                  'id -u; id -g; echo "$HOME"; touch /opt/ddpipe/repo/.written "$HOME/.written" && echo written; '
                  'test -w /opt/ddpipe/venv/bin || echo venv-read-only').stdout.split()
    assert said == [str(IMAGE_UID), str(IMAGE_UID), "/home/ddpipe", "written", "venv-read-only"], said


def test_two_containers_train_as_two_nodes_stop_with_75_and_resume_bit_equal(image: str, tmp_path: Path,
                                                                             prepared: Path) -> None:
    reference = tmp_path / "reference"
    run([sys.executable, "-m", "ddpipe.launch",
         *args_for(reference, prepared, *TRAINING, "distributed.nproc_per_node=2")], env=CLONE_ENV, timeout=900)
    job = tmp_path / "job"
    job.mkdir()
    nodes = two_nodes(image, job, prepared, "stopped")
    try:
        wait_for_step_checkpoint(job / "ckpt", 2, 2, lambda: all(n.poll() is None for n in nodes), seconds=600)
    except AssertionError as e:
        for n in nodes:
            if n.poll() is None:
                n.kill()
        raise AssertionError(f"{e}\n" + "\n".join(n.communicate()[0][-3000:] for n in nodes)) from None
    started = time.time()
    podman("kill", "--signal", "TERM", "stopped-0", "stopped-1")
    outs = [n.communicate(timeout=300)[0] for n in nodes]
    text = "".join(outs)
    assert [n.returncode for n in nodes] == [EXIT_PREEMPTED] * 2, text[-4000:]
    (sig, epoch, step), = set(STOPPED.findall(text))
    assert sig == "SIGTERM" and epoch in ("2", "3"), text[-4000:]
    print(f"stopped at epoch {epoch}, step {step}, {time.time() - started:.1f} s after the SIGTERM")

    again = two_nodes(image, job, prepared, "resumed")
    outs = [n.communicate(timeout=900)[0] for n in again]
    assert [n.returncode for n in again] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert any(f"resuming from {job / 'ckpt'} at epoch {epoch}, step {step}" in out for out in outs), outs[0][-3000:]
    assert same_weights(weights(job / "model.pt"), weights(reference / "model.pt"))
    for name in ("stopped-0", "stopped-1", "resumed-0", "resumed-1"):
        podman("rm", "-f", name, check=False)
    assert torch.load(job / "model.pt", weights_only=True)["state_dict"]
