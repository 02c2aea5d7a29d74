"""The data path at real size: a generated class-per-folder set, prepared and trained as a user would.

    python bench/data_path.py                               # both sections, sets of 10,000 and 40,000 images
    python bench/data_path.py --only loader --sizes 10000   # one section, one size

Sections (``--only``):
- ``pipeline``: for each size, a copy of the repository with params.yaml set for the folder
  (``data.dataset=imagefolder``, ``data.source_dir``, ``data.image_size=64``, 2 processes, 1 epoch) runs
  ``dvc repro`` one stage at a time, each under a sampler of the memory its process tree holds for itself
  (Pss_Anon + Pss_Shmem of every process, from /proc/PID/smaps_rollup: a memory-mapped file's page cache is
  not counted, forked workers are not counted twice). Prints seconds, images/s per core and the tree's peak
  for the data stages, the peak of each training process, and the test accuracy; then the whole pipeline
  once more in one ``dvc repro --force``, its tree's peak and DVC's own process.
- ``loader``: on the smallest size's prepared training split, the single-core decode-only limit (every
  stored file decoded once, one thread) against the DataLoader alone (decode, random-resized crop, flip, the
  batch handed to the training process) with 0, 1 and 2 workers, at 64 and 224 px.

The sets (``bench/imageset.py``) are generated once into bench/results/imageset-<size> and reused. Prints
the machine and Markdown tables; appends to bench/results/data_path.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch
from common import REPO, RESULTS, append_jsonl, clean_env, markdown_table, print_machine, temp_dir
from imageset import generate
from omegaconf import OmegaConf

from ddpipe.config.load import load_config
from ddpipe.core.devices import PrecisionPolicy, cpu_count
from ddpipe.data.store import load_meta, open_split
from ddpipe.data.transforms import decode
from ddpipe.engine.resolved import resolve

STAGES = ("fetch", "prepare", "train", "evaluate")


# ---------------------------------------------------------------------------------------------
# Memory of a process tree


def _own_mib(pid: int) -> float | None:
    """Pss_Anon + Pss_Shmem of one process, MiB (None once it is gone)."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:])
        return sum(int(fields[k].split()[0]) for k in ("Pss_Anon", "Pss_Shmem") if k in fields) / 1024
    except (OSError, ValueError):
        return None


def _tree(root: int) -> dict[int, int]:
    """{pid: parent pid} of ``root`` and its descendants."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    out, todo = {root: 0}, [root]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            out[child] = pid
            todo.append(child)
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def measured(cmd: list[str], cwd: Path, env: dict[str, str]) -> dict:
    """Run ``cmd``; its seconds, exit code, output tail, the tree's peak sum and each process's peak (MiB),
    sampled every 0.2 s."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout or []), daemon=True)
    reader.start()
    t0, peak_sum, peaks = time.perf_counter(), 0.0, {}
    while proc.poll() is None:
        total = 0.0
        for pid, parent in _tree(proc.pid).items():
            mib = _own_mib(pid)
            if mib is None:
                continue
            total += mib
            entry = peaks.setdefault(pid, {"cmd": _cmdline(pid)[:160], "pid": pid, "ppid": parent, "mib": 0.0})
            entry["mib"] = max(entry["mib"], mib)
        peak_sum = max(peak_sum, total)
        time.sleep(0.2)
    reader.join()
    return {"seconds": time.perf_counter() - t0, "rc": proc.returncode, "tail": "".join(out)[-3000:],
            "tree_peak_mib": peak_sum, "processes": sorted(peaks.values(), key=lambda e: -e["mib"])}


# ---------------------------------------------------------------------------------------------
# Sections


def image_set(size: int) -> Path:
    root = RESULTS / f"imageset-{size}"
    if not (root / ".complete").is_file():
        shutil.rmtree(root, ignore_errors=True)
        generate(root, size)
        (root / ".complete").write_text("")
    return root


def _repo_copy(copy: Path, params: dict[str, object]) -> None:
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for rel in (f for f in files if f and (REPO / f).is_file()):
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, copy / rel)
    doc = OmegaConf.load(copy / "params.yaml")
    for key, value in params.items():
        OmegaConf.update(doc, key, value)
    OmegaConf.save(doc, copy / "params.yaml")
    for path in ("dvc.lock", "models/run.json"):
        (copy / path).unlink(missing_ok=True)
    subprocess.run("git init -q && git add -A && git -c user.name=bench -c user.email=bench@ddpipe.invalid "
                   "commit -qm copy", shell=True, cwd=copy, check=True)


def pipeline(size: int) -> dict:
    """``dvc repro`` of the folder one stage at a time, each measured; then the whole pipeline again in one
    ``dvc repro --force``, measured as one tree (the way a user runs it)."""
    source = image_set(size)
    params = {"data.dataset": "imagefolder", "data.source_dir": str(source), "data.image_size": 64,
              "distributed.nproc_per_node": 2, "num_epochs": 1, "train.progress_bar": False}
    record: dict = {"section": "pipeline", "images": size, "params": params, "stages": {}}
    with temp_dir("data-path-") as copy:
        _repo_copy(copy, params)
        env = clean_env(PYTHONPATH=str(copy / "src"))
        for stage in STAGES:
            result = measured(["dvc", "repro", "--single-item", stage], copy, env)
            if result["rc"] != 0:
                raise RuntimeError(f"dvc repro {stage} failed:\n{result['tail']}")
            record["stages"][stage] = result
        shutil.rmtree(copy / "checkpoints")  # or the train stage would only write its outputs again
        record["whole"] = measured(["dvc", "repro", "--force"], copy, env)  # as a user runs it: one DVC process
        if record["whole"]["rc"] != 0:
            raise RuntimeError(f"dvc repro failed:\n{record['whole']['tail']}")
        meta = json.loads((copy / "data" / "prepared" / "meta.json").read_text())
        record["sizes"] = meta["sizes"]
        record["test"] = json.loads((copy / "metrics" / "test.json").read_text())["test"]
        record["train"] = json.loads((copy / "metrics" / "train.json").read_text())["train"]
    return record


def _ranks(processes: list[dict]) -> tuple[list[float], list[float]]:
    """Peaks of the training processes (torchrun's children) and of their loader workers (the ranks' children,
    forked: the same command line)."""
    runners = {p["pid"] for p in processes if "torch.distributed.run" in p["cmd"]}
    ranks = {p["pid"]: p["mib"] for p in processes if p["ppid"] in runners}
    workers = [p["mib"] for p in processes if p["ppid"] in ranks and "multiprocessing" not in p["cmd"]]
    return sorted(ranks.values(), reverse=True), sorted(workers, reverse=True)


def print_pipeline(records: list[dict]) -> None:
    rows = []
    for r in records:
        s = r["stages"]
        prep = s["prepare"]
        data_peak = max(s["fetch"]["tree_peak_mib"], prep["tree_peak_mib"])
        ranks, workers = _ranks(s["train"]["processes"])
        own = float(re.search(r"; ([\d.]+) s\n", prep["tail"])[1])  # the stage's own seconds, without DVC's
        rows.append([r["images"], round(prep["seconds"], 1), round(own, 1), round(own / r["images"] * 1000, 2),
                     round(r["images"] / own / cpu_count()), round(data_peak),
                     " / ".join(str(round(m)) for m in ranks), " / ".join(str(round(m)) for m in workers),
                     round(s["train"]["tree_peak_mib"]),
                     round(s["train"]["seconds"], 1), round(r["test"]["accuracy"], 4)])
    print(markdown_table(["images", "dvc repro prepare s", "prepare's own s", "ms/image", "images/s per core",
                          "data stages peak MiB (tree)", "training processes MiB (own, each)",
                          "their loader workers MiB (each)",
                          "train stage peak MiB (tree)", "train stage s", "test accuracy (1 epoch)"], rows))


def print_whole(records: list[dict]) -> None:
    rows = []
    for r in records:
        w = r["whole"]
        dvc = max(p["mib"] for p in w["processes"] if p["ppid"] == 0)  # the measured command itself: DVC
        ranks, workers = _ranks(w["processes"])
        rows.append([r["images"], round(w["seconds"], 1), round(w["tree_peak_mib"]), round(dvc),
                     " / ".join(str(round(m)) for m in ranks), " / ".join(str(round(m)) for m in workers)])
    print(markdown_table(["images", "dvc repro --force s", "tree peak MiB (every process, DVC's included)",
                          "DVC's own process MiB", "training processes MiB", "their loader workers MiB"], rows))


def loader(size: int) -> list[dict]:
    """Decode-only limit against the loader with 0, 1 and 2 workers, on the prepared training split."""
    source = image_set(size)
    with temp_dir("loader-") as tmp:
        cfg = load_config(["data.dataset=imagefolder", f"data.source_dir={source}", f"paths.prepared={tmp}/p"],
                          params_file=REPO / "params.yaml")
        from ddpipe.data.prepare import prepare

        prepare(cfg.data, cfg.seed, tmp / "raw", tmp / "p")
        meta = load_meta(tmp / "p")
        split = open_split(tmp / "p", "train", meta)
        torch.set_num_threads(1)
        limit = 0.0
        for _ in range(2):  # every training image, as the loader's epoch below; the faster pass (the second:
            t0 = time.perf_counter()  # the page cache warm, as it is for the loader)
            for i in range(len(split)):
                decode(split.blob(i), meta.num_channels)
            limit = max(limit, len(split) / (time.perf_counter() - t0))
        records = []
        compute = PrecisionPolicy(torch.device("cpu"), "fp32", channels_last=False)
        for side in (64, 224):
            read = resolve(replace(cfg, data=replace(cfg.data, image_size=side),
                                   train=replace(cfg.train, batch_size_per_rank="64"),
                                   paths=replace(cfg.paths, prepared=str(tmp / "p"))), torch.device("cpu"), meta)
            for workers in (0, 1, 2):
                data = read.training_data(meta, compute, rank=0, world_size=1, num_workers=workers)
                try:
                    for _ in data.train_batches(0, 0, 4):  # workers started, first batches out
                        pass
                    t0, count = time.perf_counter(), 0
                    for images, _, _ in data.train_batches(1):
                        count += len(images)
                    rate = count / (time.perf_counter() - t0)
                finally:
                    data.loader.close()
                records.append({"section": "loader", "images": size, "side": side, "workers": workers,
                                "images_per_s": rate, "per_worker": rate / max(1, workers),
                                "decode_limit": limit, "ratio": rate / max(1, workers) / limit})
                print(f"  {side} px, {workers} worker(s): {rate:.0f} images/s", flush=True)
    return records


def print_loader(records: list[dict]) -> None:
    rows = [[r["side"], r["workers"], round(r["images_per_s"]), round(r["per_worker"]), round(r["decode_limit"]),
             round(r["ratio"], 2)] for r in records]
    print(markdown_table(["crop px", "workers", "loader images/s", "per worker (0: the training process)",
                          "decode-only limit, 1 core", "per worker / limit"], rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="pipeline,loader")
    p.add_argument("--sizes", default="10000,40000")
    a = p.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",")]
    print_machine()
    if "pipeline" in a.only:
        records = []
        for size in sizes:
            print(f"pipeline, {size} images ...", flush=True)
            records.append(pipeline(size))
            append_jsonl("data_path", records[-1:])
        print_pipeline(records)
        print_whole(records)
    if "loader" in a.only:
        records = loader(sizes[0])
        append_jsonl("data_path", records)
        print_loader(records)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
