"""The INT8 copies of a trained model scored on CPUs with and without VNNI: each copy's answers against the PyTorch
model's, natively and on an AVX2-only CPU emulated by qemu-user.

    python bench/int8_cpus.py --repo /path/to/a/checkout           # its models/model.pt, after `dvc repro train`
    python bench/int8_cpus.py --repo DIR --images 2000 --qemu-cpu EPYC-Rome

From the checkout's params.yaml and ``paths.model``: the fp32 graph (``ddpipe.export.graph.export_onnx``) and one
static INT8 copy per kind of ``--kinds`` (``ddpipe.export.int8.quantize``, calibrated as the export stage does), then
each graph scored on the test split's first ``--images`` images natively and under ``qemu-x86_64 -cpu <--qemu-cpu>``
(Debian's ``qemu-user``: EPYC-Rome is an AVX2 CPU without AVX-512 or VNNI; ONNX Runtime picks its kernels by CPUID,
and qemu computes VPMADDUBSW's saturating int16 sums as the silicon does). Scoring runs in a child process that
imports only numpy and ONNX Runtime (importing torch under qemu takes minutes), one thread, batches of 256, answers
through a file. Accuracy, and agreement with the PyTorch model's answers on this CPU (the export stage's reference).
Prints the machine and a Markdown table; appends to bench/results/int8_cpus.jsonl.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SCORE_BATCH = 256


def score_child(graph: str, images: str, out: str) -> None:
    """The child: ``graph``'s top-1 answers for the uint8 images in ``images`` (.npy), saved to ``out`` (.npy)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])
    name, x = session.get_inputs()[0].name, np.load(images)
    answers = [session.run(None, {name: x[a:a + SCORE_BATCH]})[0].argmax(1) for a in range(0, len(x), SCORE_BATCH)]
    np.save(out, np.concatenate(answers))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", type=Path, help="a checkout whose train stage has run (default: this one)")
    p.add_argument("--images", type=int, default=0, help="the test split's first N images (0: all)")
    p.add_argument("--kinds", default="x86-vnni,x86-no-vnni", help="the CPUs the INT8 copies are made for")
    p.add_argument("--qemu-cpu", default="EPYC-Rome", help="qemu-x86_64's CPU model for the emulated run ('': none)")
    p.add_argument("--score", nargs=3, metavar=("GRAPH", "IMAGES", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.score:
        score_child(*args.score)
        return 0

    import torch
    from common import REPO, append_jsonl, markdown_table, print_machine

    from ddpipe.config.load import load_config
    from ddpipe.engine.evaluation import TestSplit
    from ddpipe.export.graph import export_onnx
    from ddpipe.export.int8 import quantize
    from ddpipe.export.stage import calibration_batches
    from ddpipe.models.served import ImageClassifier

    repo = (args.repo or REPO).resolve()
    qemu = shutil.which("qemu-x86_64") if args.qemu_cpu else None
    if args.qemu_cpu and not qemu:
        p.error("qemu-x86_64 not found (Debian: apt-get install qemu-user), or pass --qemu-cpu ''")
    print_machine()
    os.chdir(repo)  # params.yaml's paths are the checkout's
    torch.set_num_threads(1)
    cfg = load_config([], params_file=repo / "params.yaml")
    classifier = ImageClassifier.load(cfg.paths.model)
    test = TestSplit(cfg, classifier)
    try:
        parts = [(x.numpy(), y.numpy()) for x, y, *_ in test.batches(SCORE_BATCH)]
    finally:
        test.close()
    images, labels = np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts])
    if args.images:
        images, labels = images[:args.images], labels[:args.images]
    reference = np.concatenate([classifier.probabilities(images[a:a + SCORE_BATCH]).argmax(1)
                                for a in range(0, len(images), SCORE_BATCH)])
    rows, records = [], []
    with tempfile.TemporaryDirectory(prefix="int8-cpus-") as tmp:
        graphs = {"fp32": Path(tmp) / "fp32.onnx"}
        export_onnx(classifier.model, classifier.saved, graphs["fp32"], cfg.export.opset)
        for kind in args.kinds.split(","):
            graphs[f"int8 for {kind}"] = Path(tmp) / f"int8-{kind}.onnx"
            quantize(graphs["fp32"], graphs[f"int8 for {kind}"], calibration_batches(cfg, classifier), kind)
        np.save(Path(tmp) / "images.npy", images)
        runners = {"native": [], **({f"qemu {args.qemu_cpu}": [qemu, "-cpu", args.qemu_cpu]} if qemu else {})}
        for graph_name, graph in graphs.items():
            for where, prefix in runners.items():
                out, start = Path(tmp) / "answers.npy", time.perf_counter()
                done = subprocess.run([*prefix, sys.executable, __file__, "--score", str(graph),
                                       str(Path(tmp) / "images.npy"), str(out)], timeout=3600, stdin=subprocess.DEVNULL,
                                      capture_output=True, text=True)  # qemu warns of CPUID bits it lacks, per thread
                if done.returncode:
                    raise RuntimeError(f"scoring {graph_name} ({where}) failed:\n{done.stderr[-3000:]}")
                answers = np.load(out)
                out.unlink()
                record = {"graph": graph_name, "cpu": where, "images": len(labels),
                          "accuracy": float((answers == labels).mean()),
                          "agreement": float((answers == reference).mean()),
                          "pytorch_accuracy": float((reference == labels).mean()),
                          "seconds": round(time.perf_counter() - start, 1)}
                records.append(record)
                rows.append([graph_name, where, f"{record['accuracy']:.4f}", f"{record['agreement']:.4f}",
                             f"{100 * (record['pytorch_accuracy'] - record['accuracy']):+.2f}", record["seconds"]])
                print(f"{graph_name}, {where}: accuracy {record['accuracy']:.4f}, agreement {record['agreement']:.4f}",
                      flush=True)
    print(f"\nmodel: {cfg.paths.model} of {repo} ({classifier.saved.model.name}), PyTorch accuracy "
          f"{records[0]['pytorch_accuracy']:.4f} on {len(labels)} test images\n")
    print(markdown_table(["graph", "CPU", "accuracy", "agreement with PyTorch", "points lost", "seconds"], rows))
    append_jsonl("int8_cpus", [{"bench": "int8_cpus", "repo": str(repo), **r} for r in records])
    return 0


if __name__ == "__main__":
    sys.exit(main())
