"""The saved model (``paths.model``): weights plus what rebuilds the network, its input normalisation and
class names, loadable with ``torch.load(weights_only=True)``.

``build_model(cfg, num_channels, num_classes)`` is what rebuilds it, so the file records exactly these three
inputs (``model.name``, ``model.kwargs``, ``model.width``; a ``module:Class`` network is imported again).
The file records its format (``format_version``, :data:`MODEL_FORMAT`), read before anything else in it.
What an exported graph of it takes, gives and says of itself (its input and output names, :func:`onnx_metadata`) is
here too, beside the fields it comes from: ``ddpipe.export`` writes it, ``ddpipe.models.onnx_served`` reads it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpipe.config.schema import ModelConfig
from ddpipe.core.files import atomic_save
from ddpipe.data.transforms import IMAGENET_CROP_RATIO
from ddpipe.models.catalog import RENAMED, build_model

# The saved model's format, written into the file as ``format_version``. 0: written before format versions existed
# (no key; see _from_format_0); 1: every field of SavedModel present.
MODEL_FORMAT = 1


def save_model(state_dict: dict[str, torch.Tensor], cfg: ModelConfig, meta: dict, path: str | Path,
               extra: dict | None = None) -> None:
    """Weights plus what rebuilds the network, its input normalisation and class names. ``meta``: the prepared
    data's ``meta.json`` fields (``dataclasses.asdict`` of ``ddpipe.data.store.Prepared``, with ``image_size``
    the input the network takes and ``mean``/``std`` the normalisation it was trained with); ``extra`` sets
    the exported epoch, the weights exported (raw or ema) and the evaluation crop (else: none, raw, ImageNet's)
    and adds plain values. ``encoding`` says how a client's image becomes that input: resized (raw), or
    centre-cropped and resized (encoded: ``ddpipe.data.transforms.EvalCrop``)."""
    payload = {
        "format_version": MODEL_FORMAT,
        "state_dict": {k: v.detach().cpu().contiguous() for k, v in state_dict.items()},
        "model": asdict(cfg),
        "num_channels": meta["num_channels"], "classes": list(meta["classes"]),
        "mean": list(meta["mean"]), "std": list(meta["std"]), "image_size": list(meta["image_size"]),
        "encoding": meta["encoding"],
        "exported_epoch": None, "exported_weights": "raw", "eval_crop_ratio": IMAGENET_CROP_RATIO,
        **(extra or {}),
    }
    atomic_save(path, lambda f: torch.save(payload, f))


@dataclass(frozen=True)
class SavedModel:
    """A :func:`save_model` file read by name (on disk it is the plain dict that ``weights_only`` loads)."""

    state_dict: dict[str, torch.Tensor]
    model: ModelConfig  # what rebuilds the network
    num_channels: int
    classes: list[str]
    mean: list[float]  # the input normalisation the network was trained with
    std: list[float]
    image_size: list[int]  # the input the network takes, [H, W] (encoded: data.eval_image_size)
    encoding: str  # how a client's image becomes that input: raw (resized) or encoded (centre crop, resize)
    exported_epoch: int | None
    eval_crop_ratio: float  # encoded: the centre crop's share of the shorter side
    exported_weights: str  # raw, or ema: the moving average of the weights (ddpipe.engine.ema)

    @classmethod
    def from_payload(cls, payload: dict[str, Any], source: str | Path = "the saved model") -> SavedModel:
        """The fields of a :func:`save_model` file (loaded from ``source``), its format read first: ValueError for
        a format newer than :data:`MODEL_FORMAT`, older ones brought to today's."""
        version = int(payload.get("format_version", 0))
        if version > MODEL_FORMAT:
            raise ValueError(f"{source}: saved-model format {version} is newer than this ddpipe reads (formats up to "
                             f"{MODEL_FORMAT}): load it with the ddpipe that saved it")
        if version < 1:
            payload = _from_format_0(payload)
        return cls(state_dict=payload["state_dict"], model=ModelConfig(**payload["model"]),
                   num_channels=int(payload["num_channels"]), classes=list(payload["classes"]),
                   mean=list(payload["mean"]), std=list(payload["std"]),
                   image_size=[int(s) for s in payload["image_size"]], encoding=payload["encoding"],
                   exported_epoch=payload["exported_epoch"], eval_crop_ratio=float(payload["eval_crop_ratio"]),
                   exported_weights=str(payload["exported_weights"]))


def _from_format_0(payload: dict[str, Any]) -> dict[str, Any]:
    """A file written before format versions existed, as format 1 holds it. Its fields arrived one at a time
    (model.eval_flips, then encoding, then the exported weights and the evaluation crop) and it does not say which
    step wrote it, so here, and only here, a field's absence tells the step."""
    known = {f.name for f in fields(ModelConfig)}  # the network's keys it lacks: today's defaults
    model = {k: v for k, v in payload["model"].items() if k in known}
    # before model.eval_flips existed, models predicted without flips; before encoded data, images were resized
    # (raw); before the other keys, no epoch was recorded, the weights were the raw ones, the crop the fixed one
    return {"encoding": "raw", "exported_epoch": None, "exported_weights": "raw",
            "eval_crop_ratio": IMAGENET_CROP_RATIO, **payload, "model": {"eval_flips": False, **model}}


def is_saved_model(payload: object) -> bool:
    """Whether a loaded file is a :func:`save_model` payload (an exported ddpipe model)."""
    return isinstance(payload, dict) and {"state_dict", "model", "classes", "mean", "std"} <= payload.keys()


def load_model(path: str | Path) -> tuple[nn.Module, SavedModel]:
    """The network saved by :func:`save_model` (on the CPU, in eval mode), and the file's fields."""
    saved = SavedModel.from_payload(torch.load(path, map_location="cpu", weights_only=True), path)
    cfg = saved.model
    model = build_model(cfg, saved.num_channels, len(saved.classes))
    try:
        model.load_state_dict(saved.state_dict)
    except RuntimeError as exc:
        if cfg.name in RENAMED:
            raise ValueError(
                f"{path}: its weights do not fit model.name = {cfg.name!r}, which now means torchvision's own "
                f"{cfg.name} (ImageNet stem); a file written before that change holds the small-image variant, now "
                f"named {RENAMED[cfg.name]!r}: retrain with model.name={RENAMED[cfg.name]}") from exc
        raise
    return model.eval(), saved


# The exported graph's contract (ddpipe.export writes it, ddpipe.models.onnx_served and any client read it)
INPUT_NAME, OUTPUT_NAME = "images", "probabilities"
INT8_CPU_KEY = "int8_cpu"  # an INT8 graph's metadata: the CPU kind it is made for (ddpipe.core.devices.cpu_int8_kind)
# An INT8 copy's weights by the CPU kind it is made for (activations are uint8 on all). ONNX Runtime's uint8 x int8
# kernels on x86 without VNNI sum pairs of products in int16 (VPMADDUBSW), which saturates: such a copy's answers
# drift there (an AVX2-only CPU emulated by qemu: 90.7% agreement with the fp32 graph against 98.9% on a VNNI CPU,
# BENCHMARKS.md). uint8 x uint8 kernels widen first and sum in int32: the same answers on every x86 CPU, slower
# than uint8 x int8 where VNNI is.
INT8_WEIGHTS = {"x86-vnni": "int8", "x86-no-vnni": "uint8", "other": "int8"}
ONNX_FORMAT = 1  # the metadata's layout, written as ddpipe.format


def onnx_metadata(saved: SavedModel) -> dict[str, str]:
    """The graph's metadata (ONNX metadata_props, strings): class names in output order and how an image becomes
    its input."""
    return {"ddpipe.format": str(ONNX_FORMAT), "classes": json.dumps(saved.classes),
            "input": f"{INPUT_NAME}: uint8 N x {saved.num_channels} x {saved.image_size[0]} x {saved.image_size[1]} "
                     "raw pixels; normalisation and test-time flips are inside the graph",
            "output": f"{OUTPUT_NAME}: N x {len(saved.classes)} class probabilities (classes' order)",
            "num_channels": str(saved.num_channels), "image_size": json.dumps(list(saved.image_size)),
            "encoding": saved.encoding, "eval_crop_ratio": repr(saved.eval_crop_ratio),
            "exported_epoch": json.dumps(saved.exported_epoch), "exported_weights": saved.exported_weights,
            "network": saved.model.name}
