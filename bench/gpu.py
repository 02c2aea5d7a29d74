"""Training throughput on one GPU: torchvision's resnet50 at 224 px, images/s.

    python bench/gpu.py                        # every row below; Markdown table; bench/results/gpu.jsonl
    python bench/gpu.py --only synthetic       # the model alone only
    python bench/gpu.py --images 16000 --batch 256 --steps 40
    make gpu-check                             # the tests and a few of these rows in 8 minutes (bench/gpu_check.py)

Rows:
- **The model alone**, on synthetic batches already on the GPU (no loader, no host copy): one training step
  (forward, label-smoothed cross-entropy, backward, SGD with momentum) per batch, timed after warm-up steps, in each
  arithmetic: fp32 (TF32, what ``train.deterministic: false`` allows), bf16 autocast, channels_last, torch.compile,
  and ``train.deterministic: true`` (ddpipe.core.devices.cuda_kernels and its pooling as reductions). Each row runs
  in a process of its own, so no switch, compile cache or cuBLAS workspace of one row reaches another.
- **torchvision's reference step**: the step references/classification/train.py takes with ``--amp`` (fp16 autocast
  and a GradScaler, the default contiguous layout), on the same synthetic batches: the same model and optimizer, only
  the arithmetic and memory format differ.
- **ddpipe's train stage**: ``python -m ddpipe.launch`` on a generated class-per-folder image set (bench/imageset.py:
  JPEGs and PNGs of 160-500 px) prepared at 224 px, ``model.name=resnet50``, the rest from params.yaml (precision and
  channels_last ``auto``: bf16 and channels_last on CUDA), twice: JPEGs decoded on the GPU a batch at a time
  (``data.decode_on: device``: one worker reads the files into pinned memory, nvJPEG decodes, the crops and flips
  follow on the GPU) and in the loader's worker processes (``workers``, auto's choice until the device is shown at
  least as fast: libjpeg-turbo, crops and flips per image, pinned copies). Each one's second epoch's images/s (the
  first one times cuDNN's algorithms) against the model alone in the same arithmetic: the share of the GPU the
  loader keeps fed (want >= 90%).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import append_jsonl, clean_env, markdown_table, print_machine, run_timed, temp_dir
from imageset import generate

# name: (precision, channels_last, compile, deterministic); "fp16-scaler" is torchvision's reference step (--amp)
ROWS = {
    "fp32 (TF32)": ("fp32", False, False, False),
    "fp32 (TF32), channels_last": ("fp32", True, False, False),
    "bf16": ("bf16", False, False, False),
    "bf16, channels_last": ("bf16", True, False, False),
    "bf16, channels_last, compile": ("bf16", True, True, False),
    "bf16, channels_last, deterministic": ("bf16", True, False, True),
    "torchvision reference step (--amp: fp16 + GradScaler)": ("fp16-scaler", False, False, False),
}
STAGE_ROWS = {  # data.decode_on -> the row's name
    "device": "ddpipe train stage: loader + model, bf16, channels_last, JPEGs decoded on the GPU",
    "workers": "ddpipe train stage: loader + model, bf16, channels_last, JPEGs decoded in the loader's workers (auto)",
}
SAME_ARITHMETIC = "bf16, channels_last"  # the model-alone row the train stage is compared with


def one_row(name: str, batch: int, steps: int, warmup: int) -> dict:
    """Time ``steps`` training steps of resnet50 on synthetic data in this process (``ROWS[name]``'s arithmetic)."""
    import torch
    import torchvision

    from ddpipe.core.devices import cuda_kernels
    from ddpipe.models.nets import global_pools_as_reductions

    precision, channels_last, compiled, deterministic = ROWS[name]
    device = torch.device("cuda", 0)
    cuda_kernels(device, deterministic)
    torch.manual_seed(0)
    model = torchvision.models.resnet50(num_classes=1000)
    if deterministic:
        global_pools_as_reductions(model)
    model = model.to(device, memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    step_model = torch.compile(model) if compiled else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16-scaler")
    dtype = {"bf16": torch.bfloat16, "fp16-scaler": torch.float16}.get(precision)
    images = torch.randn(batch, 3, 224, 224, device=device)
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (batch,), device=device)

    def step() -> None:
        with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
            loss = loss_fn(step_model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t1
    return {"row": name, "images_per_s": batch * steps / seconds, "batch": batch, "steps": steps,
            "warmup_s": t1 - t0, "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}


def row_command(name: str, batch: int, steps: int, warmup: int) -> list[str]:
    """The command that times ``ROWS[name]`` in a process of its own; its last line on stdout is the row's JSON."""
    return [sys.executable, str(Path(__file__).resolve()), "--row", name, "--batch", str(batch), "--steps",
            str(steps), "--warmup", str(warmup)]


def synthetic(batch: int, steps: int, warmup: int) -> list[dict]:
    rows = []
    for name in ROWS:
        out = subprocess.run(row_command(name, batch, steps, warmup), capture_output=True, text=True, env=_env())
        if out.returncode != 0:
            print(f"{name}: exit {out.returncode}\n{out.stderr[-2000:]}", flush=True)
            rows.append({"row": name, "error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "?"})
            continue
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"{name}: {rows[-1]['images_per_s']:.0f} images/s", flush=True)
    return rows


def train_stage(images: int, batch: int) -> list[dict]:
    """The launcher's two epochs of resnet50 on the generated folder at 224 px, once for each place images are
    decoded (``data.decode_on``); each one's second epoch's images/s."""
    rows = []
    with temp_dir("ddpipe-gpu-") as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        generate(tmp / "images", images)
        generated = time.perf_counter() - t0
        prepare_s = run_timed(prepare_command(tmp), env=_env())
        for where, row in STAGE_ROWS.items():
            train_s = run_timed(launch_command(tmp, where, batch), env=_env())
            rows.append({"row": row, **stage_figures(tmp, where), "batch": batch, "images": images,
                         "generate_s": generated, "prepare_s": prepare_s, "train_s": train_s})
    return rows


def _data_keys(tmp: Path) -> list[str]:
    return ["data.dataset=imagefolder", f"data.source_dir={tmp / 'images'}", "data.image_size=224",
            "data.val_fraction=0.05", "data.test_fraction=0.05", f"paths.prepared={tmp / 'prepared'}",
            f"paths.raw={tmp / 'raw'}"]


def prepare_command(tmp: Path) -> list[str]:
    """The prepare stage over ``tmp``/images (the generated folder), its output under ``tmp``."""
    return [sys.executable, "stages/prepare.py", *_data_keys(tmp)]


def launch_command(tmp: Path, where: str, batch: int) -> list[str]:
    """The train stage's launcher: two epochs of resnet50 on ``tmp``'s prepared images, decoded on ``where``
    (``data.decode_on``), its outputs under ``tmp``/``where``."""
    run = tmp / where
    return [sys.executable, "-m", "ddpipe.launch", *_data_keys(tmp), "model.name=resnet50",
            f"train.batch_size_per_rank={batch}", "num_epochs=2", f"data.decode_on={where}",
            "train.progress_bar=false", "mlflow.log_model=false", "mlflow.log_system_metrics=false",
            f"mlflow.tracking_uri=sqlite:///{run}/mlflow.db", f"mlflow.outbox={run}/outbox",
            *(f"paths.{k}={run}/{v}" for k, v in (("checkpoints", "ckpt"), ("model", "model.pt"),
                                                  ("run_info", "run.json"), ("train_metrics", "train.json"),
                                                  ("history", "history.csv")))]


def stage_figures(tmp: Path, where: str) -> dict[str, float]:
    """What :func:`launch_command` measured: its last (second) and first epochs' images/s."""
    with (tmp / where / "history.csv").open() as f:
        epochs = list(csv.DictReader(f))
    return {"images_per_s": float(epochs[-1]["images_per_s"]),
            "first_epoch_images_per_s": float(epochs[0]["images_per_s"])}


def _env() -> dict[str, str]:
    """The benchmark's environment for its children, PYTHONPATH kept (a machine with no editable install)."""
    return clean_env(PYTHONPATH=os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("synthetic", "stage"), help="one part only")
    parser.add_argument("--batch", type=int, default=256, help="images per step (default 256)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per model-alone row (default 30)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (default 10)")
    parser.add_argument("--images", type=int, default=12000, help="the generated folder's images (default 12000)")
    parser.add_argument("--row", choices=list(ROWS), help=argparse.SUPPRESS)  # one row, in this process
    args = parser.parse_args()
    if args.row:
        print(json.dumps(one_row(args.row, args.batch, args.steps, args.warmup)))
        return
    print_machine()
    rows = [] if args.only == "stage" else synthetic(args.batch, args.steps, args.warmup)
    if args.only != "synthetic":
        for row in train_stage(args.images, args.batch):
            rows.append(row)
            print(f"{row['row']}: {row['images_per_s']:.0f} images/s", flush=True)
    alone = next((r["images_per_s"] for r in rows if r["row"] == SAME_ARITHMETIC and "images_per_s" in r), None)
    table = [[r["row"], f"{r['images_per_s']:.0f}" if "images_per_s" in r else r["error"],
              f"{r['peak_gib']:.1f}" if "peak_gib" in r else "",
              f"{r['images_per_s'] / alone:.2f}" if alone and "images_per_s" in r else ""] for r in rows]
    print(markdown_table([f"resnet50, 224 px, batch {args.batch}", "images/s", "peak GiB", "x bf16+CL alone"],
                         table))
    append_jsonl("gpu", rows)


if __name__ == "__main__":
    main()
