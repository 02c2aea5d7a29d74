"""The schema's ``export`` section: what the export stage makes of the trained model (ONNX, an INT8 copy), how it is
calibrated and timed, and the thresholds it must pass (``ddpipe.export``, docs/export.md). The rules that tie its
keys to others (a split that exists, an opset the exporter takes) are checked by the stage before any work."""

# No ``from __future__ import annotations``: OmegaConf.structured reads the field types at runtime (as in schema.py).
from dataclasses import dataclass, field

from ddpipe.config.param import ConfigError, param
from ddpipe.config.rules import not_accepted

FORMATS = ("onnx",)  # what export.formats names; the INT8 copy is export.int8's
# export.int8_cpu: the CPUs an INT8 copy is made for (ddpipe.core.devices.cpu_int8_kind names the one that runs)
INT8_CPUS = ("auto", "x86-vnni", "x86-no-vnni", "other")


@dataclass
class ExportConfig:
    """The export stage: the trained model as ONNX graphs (raw uint8 images in, probabilities out), each checked with
    ONNX Runtime on the whole test split against the PyTorch model before it counts (docs/export.md)."""

    formats: list[str] = field(default_factory=lambda: ["onnx"], metadata={
        "doc": "The graphs the stage makes: onnx (paths.onnx, fp32, torch.onnx.export's dynamo exporter, the batch "
               "dimension dynamic).", "trajectory": False, "words": "a non-empty list of: " + ", ".join(FORMATS)})
    int8: bool = param(
        True, "Also a static INT8 copy (paths.onnx_int8: ONNX Runtime's quantize_static, QDQ, per-channel weights), "
        "calibrated on calibration_images images of calibration_split. Off: drop paths.onnx_int8 from the export "
        "stage's outs in dvc.yaml too (DVC fails a stage whose output is missing).")
    int8_cpu: str = param(
        "auto", "The CPUs the INT8 copy is made for: x86-vnni (AVX512-VNNI, AVX-VNNI or AMX: uint8 activations x int8 "
        "weights, the fast kernels), x86-no-vnni (AVX2 or AVX-512 without VNNI, whose uint8 x int8 kernels saturate: "
        "uint8 weights), other (ARM and the rest: as x86-vnni); auto: the CPU the stage runs on. Recorded in the "
        "graph's metadata, metrics and the model version's tags; a copy served on another kind says so.",
        choices=INT8_CPUS, trajectory=False)
    opset: int = param(18, "ONNX opset of the graphs: the dynamo exporter writes 18 and later, up to the newest the "
                       "installed onnx knows (the stage checks it before any work).", ge=18)
    calibration_split: str = param(
        "train", "The prepared split whose images calibrate the INT8 copy (never test: the check's own split).",
        words="train or val")
    calibration_images: int = param(256, "How many images of calibration_split calibrate it (seeded sample).", ge=1)
    latency_batch_sizes: list[int] = field(default_factory=lambda: [1, 64], metadata={
        "doc": "Batch sizes at which the stage times each format on the CPU (p50 and p99 per batch).",
        "trajectory": False, "words": "a non-empty list of integers >= 1"})
    latency_runs: int = param(30, "Timed runs per format and batch size (after 3 untimed), into paths.export_host; "
                              "0: not timed (no latency_ms there).", ge=0)
    min_agreement: float = param(
        0.999, "fp32 graphs: the least share of test images whose top-1 class equals the PyTorch model's; below it "
        "the stage fails and writes nothing.", ge=0.0, le=1.0)
    max_int8_accuracy_drop: float = param(
        0.01, "The INT8 copy: the most test accuracy (a share: 0.01 is 1 point) it may lose against the PyTorch "
        "model; more fails the stage.", ge=0.0, le=1.0)


def check_export(cfg: ExportConfig, set_in: dict[str, str]) -> None:
    """The keys of ``export`` that a field's bounds cannot say: its lists' members and the calibration split."""
    def where(key: str) -> str | None:
        return set_in.get(f"export.{key}")

    if not cfg.formats or any(f not in FORMATS for f in cfg.formats) or len(set(cfg.formats)) != len(cfg.formats):
        raise not_accepted("export.formats", list(cfg.formats), "a non-empty list of distinct formats of: "
                           + ", ".join(FORMATS) + " (the INT8 copy: export.int8)", where("formats"))
    sizes = list(cfg.latency_batch_sizes)
    if not sizes or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in sizes):
        raise not_accepted("export.latency_batch_sizes", sizes, "a non-empty list of integers >= 1",
                           where("latency_batch_sizes"))
    if cfg.calibration_split not in ("train", "val"):
        why = " (the test split is the check's own: calibrating on it would grade the copy on what tuned it)" \
            if cfg.calibration_split == "test" else ""
        raise ConfigError(f"{where('calibration_split') + ': ' if where('calibration_split') else ''}"
                          f"export.calibration_split = {cfg.calibration_split!r} is not accepted; expected train or "
                          f"val, a split of the prepared data{why}")
