"""`make gpu-check` (issue 71), checked on the CPU so that a short session on a GPU machine runs it as written: the
target's command, its arguments, and each of its steps a command that runs (the GPU's own steps as far as a CPU can:
their arguments parsed, the tests collected, the train stage's commands run up to the point where they would train)."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import ROOT, run

pytestmark = pytest.mark.slow
CHECK = [sys.executable, "bench/gpu_check.py"]


def test_make_gpu_check_runs_the_check_within_8_minutes() -> None:
    recipe = run(["make", "--no-print-directory", "-n", "gpu-check"]).stdout.strip().splitlines()
    assert recipe[-1] == "python bench/gpu_check.py --budget-s 480", recipe  # 8 minutes, from the venv (make setup)
    assert run([*CHECK, "--help"]).stdout.startswith("usage: python bench/gpu_check.py")
    wrong = run([*CHECK, "--budget"], check=False)
    assert wrong.returncode == 2 and "--budget" in wrong.stderr


def test_each_step_of_the_gpu_check_is_a_command_that_runs(tmp_path) -> None:  # noqa: ANN001
    """The dry run's steps: the tests (collected), the model alone in bf16 and fp32 (bench/gpu.py's rows, their
    arguments parsed), the images generated and prepared (run, small), the train stage's launcher decoding in the
    workers and on the device (run with --print: every check before training); within the budget."""
    plan = json.loads(run([*CHECK, "--dry-run", "--work", str(tmp_path), "--images", "100", "--batch", "8"]).stdout)
    steps = {step["name"]: step for step in plan}
    assert list(steps) == ["model alone, bf16", "model alone, fp32", "generate images", "prepare",
                           "train stage, decoded in the workers", "train stage, decoded on the GPU", "test-gpu"]
    assert sum(step["keep_s"] for step in plan) <= 480 - 30  # every step fits, with the stops' grace
    assert steps["test-gpu"]["cmd"][1:] == ["-m", "pytest", "-v", "tests/test_gpu.py"]  # make test-gpu's command
    collected = run([sys.executable, "-m", "pytest", "--collect-only", "-q", "tests/test_gpu.py"]).stdout
    assert "tests/test_gpu.py::test_jpegs_decoded_on_the_gpu_match_the_workers_and_train" in collected, collected
    for name in ("model alone, bf16", "model alone, fp32"):
        cmd = steps[name]["cmd"]
        assert "--row" in cmd and run([*cmd, "--help"]).returncode == 0  # the row and the numbers parsed first
    run(steps["generate images"]["cmd"])
    run(steps["prepare"]["cmd"])
    assert (tmp_path / "prepared" / "meta.json").is_file()
    for where in ("workers", "GPU"):
        cmd = steps[f"train stage, decoded {'in the' if where == 'workers' else 'on the'} {where}"]["cmd"]
        assert cmd[1:3] == ["-m", "ddpipe.launch"]
        # train.auto_by=table: on a CPU the launcher would time ResNet-50's candidates first (on CUDA it never does)
        printed = run([*cmd[:3], "--print", *cmd[3:], "train.auto_by=table"], cwd=ROOT).stdout
        assert "torch.distributed.run" in printed and f"data.decode_on={where.lower().replace('gpu', 'device')}" \
            in printed, printed
