"""One GPU check, prepared to run in a single short session on a machine with a CUDA GPU (issue 71).

    make gpu-check                                  # make setup (the lock's versions), then this; at most 8 minutes
    python bench/gpu_check.py --dry-run             # the steps' commands and time limits, run nothing
    python bench/gpu_check.py --budget-s 480 --out bench/results/gpu-check.json

Its steps, each a command in a process group of its own with a time limit (the budget less what the steps after it
keep for themselves; a step past its limit is stopped, SIGTERM then SIGKILL, and the next one runs):

1. ResNet-50 at 224 px alone on synthetic batches, images/s, in bf16 with channels_last and in fp32 (TF32), what the
   train stage runs in each (bench/gpu.py's rows);
2. the train stage on a generated folder of JPEGs and PNGs (bench/imageset.py) prepared at 224 px: two epochs of
   ResNet-50 in bf16, the images decoded in the loader's workers (auto's choice) and on the GPU (nvJPEG); each one's
   second epoch's images/s;
3. ``make test-gpu``'s command: tests/test_gpu.py (nvJPEG must decode every JPEG there: it counts them). Last, so that
   it has what the figures left of the budget, and the figures come even if it hangs.

The figures: the model's images/s in each precision, the loader's ratio to the model alone (train stage / model
alone, bf16: the share of the GPU the loader keeps fed) for each place of decoding, and device decoding against the
workers' (whether ``data.decode_on: auto`` may become the device on CUDA: at least as fast). Written to ``--out`` (JSON,
with the GPU, the versions and each step's exit, time and last lines) and printed; exit 1 when a step failed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common import REPO, RESULTS, clean_env, markdown_table
from gpu import SAME_ARITHMETIC, launch_command, prepare_command, row_command, stage_figures

BUDGET_S = 480  # the whole check, setup apart: 8 minutes
FP32 = "fp32 (TF32)"  # the model-alone row of the train stage's fp32 (channels_last is auto's only with bf16/fp16)
GRACE_S = 20  # after SIGTERM, before SIGKILL (the launcher checkpoints and stops its workers)


@dataclass
class Step:
    """One command of the check; ``keep_s``: the seconds it keeps out of the budget for itself (the steps before it
    may not use them); ``needs``: the steps whose output it reads (it does not run when one failed)."""

    name: str
    cmd: list[str]
    keep_s: float
    needs: tuple[str, ...] = ()
    rc: int | None = None
    seconds: float = 0.0
    limit_s: float = 0.0
    tail: str = ""
    stdout: str = field(default="", repr=False)


def plan(work: Path, batch: int, steps: int, warmup: int, images: int) -> list[Step]:
    """The check's steps, in order, over the scratch directory ``work``."""
    data = ("generate images", "prepare")
    return [
        Step("model alone, bf16", row_command(SAME_ARITHMETIC, batch, steps, warmup), 40),
        Step("model alone, fp32", row_command(FP32, batch, steps, warmup), 45),
        Step("generate images", [sys.executable, "bench/imageset.py", str(work / "images"), "--images", str(images)],
             25),
        Step("prepare", prepare_command(work), 30, data[:1]),
        Step("train stage, decoded in the workers", launch_command(work, "workers", batch), 45, data),
        Step("train stage, decoded on the GPU", launch_command(work, "device", batch), 45, data),
        Step("test-gpu", [sys.executable, "-m", "pytest", "-v", "tests/test_gpu.py"], 200),
    ]


def run_step(step: Step, limit_s: float) -> None:
    """Run ``step`` from the repository's root for at most ``limit_s`` seconds, in its own process group (torchrun's
    workers stop with it)."""
    step.limit_s = limit_s
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(step.cmd, cwd=REPO, env=clean_env(PYTHONPATH=os.environ.get("PYTHONPATH", ""),
                                                                  PYTHONUNBUFFERED="1"),
                                stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            step.rc = proc.wait(timeout=max(1.0, limit_s))
        except subprocess.TimeoutExpired:
            _stop(proc)
            step.rc = None
        step.seconds = time.perf_counter() - start
        out.seek(0)
        step.stdout = out.read()
    step.tail = "\n".join(step.stdout.strip().splitlines()[-12:])


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


def figures(steps: dict[str, Step], work: Path) -> dict[str, float]:
    """The check's figures from the steps that succeeded."""
    found: dict[str, float] = {}
    for name, key in (("model alone, bf16", "resnet50_224_bf16_channels_last_images_per_s"),
                      ("model alone, fp32", "resnet50_224_fp32_tf32_images_per_s")):
        if steps[name].rc == 0:
            found[key] = json.loads(steps[name].stdout.strip().splitlines()[-1])["images_per_s"]
    for where, name in (("workers", "train stage, decoded in the workers"), ("device", "train stage, decoded on "
                                                                                      "the GPU")):
        if steps[name].rc == 0:
            found[f"train_stage_decoded_on_{where}_images_per_s"] = stage_figures(work, where)["images_per_s"]
    alone = found.get("resnet50_224_bf16_channels_last_images_per_s")
    for where in ("workers", "device"):
        stage = found.get(f"train_stage_decoded_on_{where}_images_per_s")
        if alone and stage:
            found[f"loader_ratio_decoded_on_{where}"] = stage / alone
    device, workers = (found.get(f"train_stage_decoded_on_{w}_images_per_s") for w in ("device", "workers"))
    if device and workers:
        found["device_decoding_over_workers"] = device / workers
    return found


def gpu_and_versions() -> dict[str, str]:
    import torch

    info = {"torch": torch.__version__, "cuda": str(torch.version.cuda), "cudnn": str(torch.backends.cudnn.version())}
    try:
        import importlib.metadata

        info["torchvision"] = importlib.metadata.version("torchvision")
    except importlib.metadata.PackageNotFoundError:
        info["torchvision"] = ""
    info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA GPU"
    return info


def check(args: argparse.Namespace, work: Path) -> int:
    """Run the steps within the budget, writing the report after each; 0 when every step passed."""
    steps = plan(work, args.batch, args.steps, args.warmup, args.images)
    by_name, start, versions = {s.name: s for s in steps}, time.perf_counter(), gpu_and_versions()
    for i, step in enumerate(steps):
        if any(by_name[n].rc != 0 for n in step.needs):
            step.tail = f"not run: it needs {', '.join(step.needs)}"
        else:  # a step stopped at its limit may take GRACE_S and 10 s more to end
            left = args.budget_s - (time.perf_counter() - start) - sum(s.keep_s for s in steps[i + 1:])
            run_step(step, left - GRACE_S - 10)
            print(f"{step.name}: exit {step.rc} in {step.seconds:.0f} s (limit {step.limit_s:.0f} s)", flush=True)
        found = figures(by_name, work)
        report = {"check": "make gpu-check (issue 71)", **versions, "budget_s": args.budget_s,
                  "wall_s": time.perf_counter() - start, "batch": args.batch, "images": args.images, "figures": found,
                  "decode_on_auto_may_be_device": found.get("device_decoding_over_workers", 0) >= 1.0,
                  "steps": [{k: v for k, v in asdict(s).items() if k != "stdout"} for s in steps]}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown_table(["figure", "value"], [[k, f"{v:.3f}" if v < 10 else f"{v:.0f}"] for k, v in found.items()]))
    print(f"written to {args.out}")
    return 0 if all(s.rc == 0 for s in steps) else 1


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/gpu_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help=f"the whole check's seconds (default {BUDGET_S})")
    p.add_argument("--out", type=Path, default=RESULTS / "gpu-check.json", help="the figures' JSON file")
    p.add_argument("--batch", type=int, default=256, help="images per step (default 256)")
    p.add_argument("--steps", type=int, default=30, help="timed steps of the model alone (default 30)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (default 10)")
    p.add_argument("--images", type=int, default=8000, help="the generated folder's images (default 8000)")
    p.add_argument("--work", type=Path, help="the scratch directory (default: a fresh one under bench/results/tmp, "
                   "removed after)")
    p.add_argument("--dry-run", action="store_true", help="print the steps (JSON) and run nothing")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.dry_run:
        steps = plan(args.work or RESULTS / "tmp" / "gpu-check", args.batch, args.steps, args.warmup, args.images)
        print(json.dumps([{"name": s.name, "cmd": s.cmd, "keep_s": s.keep_s, "needs": s.needs} for s in steps],
                         indent=2))
        return 0
    if args.work:
        args.work.mkdir(parents=True, exist_ok=True)
        return check(args, args.work)
    (RESULTS / "tmp").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-check-", dir=RESULTS / "tmp") as work:
        return check(args, Path(work))


if __name__ == "__main__":
    sys.exit(main())
