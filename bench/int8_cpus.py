"""The INT8 copy on each CPU kind: how far each way of quantising agrees with the fp32 graph on this CPU and on an
x86 CPU without VNNI, emulated by qemu's user mode (Debian's qemu-user; ``-cpu EPYC-Rome``: AVX2, no AVX-512, no
VNNI), and whether its answers depend on the batch.

    python bench/int8_cpus.py models/model.pt data/prepared OUT [--images 1000] [--qemu-cpu EPYC-Rome]

The copies are made here, natively, with the export stage's own ``quantize`` for each CPU kind it knows
(``ddpipe.models.saved.INT8_WEIGHTS``), plus ONNX Runtime's other advice for CPUs without VNNI (``reduce_range``:
7-bit int8 weights), for comparison. Each is scored on the first ``--images`` images of the prepared test split at
batch 7 and batch 256, natively and under qemu, against the fp32 graph's answers on this CPU. qemu emulates the
instructions (VPMADDUBSW's int16 saturation included) and runs about 50x slower: keep ``--images`` near 1000.
Prints one Markdown row per copy and CPU.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BATCHES = (7, 256)


def make_copies(model: Path, prepared: Path, out: Path) -> dict[str, Path]:
    """fp32 and the INT8 copies of ``model`` in ``out``: one per CPU kind, and the reduce_range variant."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    from ddpipe.export.graph import export_onnx
    from ddpipe.export.int8 import CALIBRATION_BATCH, quantize
    from ddpipe.models.saved import INT8_WEIGHTS
    from ddpipe.models.served import ImageClassifier

    classifier = ImageClassifier.load(model)
    graphs = {"fp32": out / "fp32.onnx"}
    export_onnx(classifier.model, classifier.saved, graphs["fp32"], 18)
    train = np.load(prepared / "train.images.npy", mmap_mode="r")
    chosen = np.sort(np.random.default_rng(42).choice(len(train), min(256, len(train)), replace=False))
    calibration = np.ascontiguousarray(train[chosen])

    def batches():  # noqa: ANN202
        return iter([calibration[a:a + CALIBRATION_BATCH] for a in range(0, len(calibration), CALIBRATION_BATCH)])

    for kind in dict.fromkeys(k for k in INT8_WEIGHTS if k != "other"):
        graphs[f"int8 for {kind}"] = out / f"int8-{kind}.onnx"
        quantize(graphs["fp32"], graphs[f"int8 for {kind}"], batches(), kind)

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = batches()

        def get_next(self) -> dict | None:
            batch = next(self.batches, None)
            return None if batch is None else {"images": batch}

    graphs["int8 u8s8 reduce_range"] = out / "int8-reduce-range.onnx"
    quantize_static(str(graphs["fp32"]), str(graphs["int8 u8s8 reduce_range"]), Reader(), quant_format=QuantFormat.QDQ,
                    per_channel=True, reduce_range=True, activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8)
    return graphs


def score(graphs: dict[str, str], images: Path, out: Path) -> None:
    """Each graph's probabilities of ``images`` at each of :data:`BATCHES`, saved as ``out/<name>-b<batch>.npy``
    (run natively or under qemu: imports only numpy and onnxruntime)."""
    import onnxruntime as ort

    x = np.load(images)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    for name, path in graphs.items():
        session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        for batch in BATCHES:
            probs = [session.run(None, {"images": x[a:a + batch]})[0] for a in range(0, len(x), batch)]
            np.save(out / f"{name.replace(' ', '_')}-b{batch}.npy", np.concatenate(probs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("prepared", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--qemu-cpu", default="EPYC-Rome")
    parser.add_argument("--score", help=argparse.SUPPRESS)  # internal: JSON {name: path}, run in a child
    args = parser.parse_args()
    if args.score:
        score(json.loads(args.score), args.out / "images.npy", args.out / args.qemu_cpu)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT / "src"))
    graphs = make_copies(args.model, args.prepared, args.out)
    np.save(args.out / "images.npy", np.load(args.prepared / "test.images.npy")[:args.images])
    labels = np.load(args.prepared / "test.labels.npy")[:args.images]
    spec = json.dumps({name: str(path) for name, path in graphs.items()})
    cpus = {"native": [sys.executable]}
    if shutil.which("qemu-x86_64"):
        cpus[f"qemu {args.qemu_cpu}"] = ["qemu-x86_64", "-cpu", args.qemu_cpu, sys.executable]
    else:
        print("qemu-x86_64 not found (apt-get install qemu-user): native figures only")
    for cpu, prefix in cpus.items():
        where = args.out / (args.qemu_cpu if cpu != "native" else "native")
        where.mkdir(exist_ok=True)
        subprocess.run([*prefix, __file__, str(args.model), str(args.prepared), str(args.out), "--score", spec,
                        "--qemu-cpu", where.name], check=True, stderr=subprocess.DEVNULL)
    reference = np.load(args.out / "native" / "fp32-b256.npy").argmax(1)
    print(f"{args.images} test images; fp32 graph on this CPU: accuracy {(reference == labels).mean():.4f}\n")
    print("| copy | CPU | accuracy | agreement with fp32 (this CPU) | answers that differ, batch 7 vs 256 |")
    print("| --- | --- | --- | --- | --- |")
    for cpu in cpus:
        where = args.out / (args.qemu_cpu if cpu != "native" else "native")
        for name in graphs:
            p7, p256 = (np.load(where / f"{name.replace(' ', '_')}-b{b}.npy").argmax(1) for b in BATCHES)
            print(f"| {name} | {cpu} | {(p256 == labels).mean():.4f} | {(p256 == reference).mean():.4f} | "
                  f"{int((p7 != p256).sum())} |")


if __name__ == "__main__":
    main()
