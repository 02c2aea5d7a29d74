"""The saved model (``paths.model``): weights plus what rebuilds the network, its input normalisation and
class names, loadable with ``torch.load(weights_only=True)``.

``build_model(cfg, num_channels, num_classes)`` is what rebuilds it, so the file records exactly these three
inputs (``model.name``, ``model.kwargs``, ``model.width``; a ``module:Class`` network is imported again).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpipe.config.schema import EVAL_CROP_RATIO, RENAMED, ModelConfig
from ddpipe.fsutil import atomic_save
from ddpipe.models.registry import build_model


def save_model(state_dict: dict[str, torch.Tensor], cfg: ModelConfig, meta: dict, path: str | Path,
               extra: dict | None = None) -> None:
    """Weights plus what rebuilds the network, its input normalisation and class names. ``meta``: the prepared
    data's ``meta.json`` fields (``dataclasses.asdict`` of ``ddpipe.data.store.Prepared``, with ``image_size``
    the input the network takes and ``mean``/``std`` the normalisation it was trained with); ``extra`` adds
    plain values (e.g. the exported epoch). ``encoding`` says how a client's image becomes that input: resized
    (raw), or centre-cropped and resized (encoded: ``ddpipe.data.transforms.EvalCrop``)."""
    payload = {
        "state_dict": {k: v.detach().cpu().contiguous() for k, v in state_dict.items()},
        "model": asdict(cfg),
        "num_channels": meta["num_channels"], "classes": list(meta["classes"]),
        "mean": list(meta["mean"]), "std": list(meta["std"]), "image_size": list(meta["image_size"]),
        "encoding": meta["encoding"],
        **(extra or {}),
    }
    atomic_save(path, lambda f: torch.save(payload, f))


@dataclass(frozen=True)
class SavedModel:
    """A :func:`save_model` file read by name (on disk it is the plain dict that ``weights_only`` loads)."""

    state_dict: dict[str, torch.Tensor]
    model: ModelConfig  # what rebuilds the network (keys of older files: today's defaults, eval_flips off)
    num_channels: int
    classes: list[str]
    mean: list[float]  # the input normalisation the network was trained with
    std: list[float]
    image_size: list[int]  # the input the network takes, [H, W] (encoded: data.eval_image_size)
    encoding: str  # how a client's image becomes that input: raw (resized) or encoded (centre crop, resize)
    exported_epoch: int | None
    eval_crop_ratio: float = EVAL_CROP_RATIO  # encoded: the centre crop's share of the shorter side
    exported_weights: str = "raw"  # raw, or ema: the moving average of the weights (ddpipe.ema)

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> SavedModel:
        known = {f.name for f in fields(ModelConfig)}
        # models saved before model.eval_flips existed predicted without flips
        model = ModelConfig(**{"eval_flips": False, **{k: v for k, v in payload["model"].items() if k in known}})
        return cls(state_dict=payload["state_dict"], model=model, num_channels=int(payload["num_channels"]),
                   classes=list(payload["classes"]), mean=list(payload["mean"]), std=list(payload["std"]),
                   image_size=[int(s) for s in payload["image_size"]],
                   encoding=payload.get("encoding", "raw"),  # models saved before encoded data: raw
                   exported_epoch=payload.get("exported_epoch"),
                   # models saved before these keys: the fixed crop of that time, raw weights
                   eval_crop_ratio=float(payload.get("eval_crop_ratio", EVAL_CROP_RATIO)),
                   exported_weights=str(payload.get("exported_weights", "raw")))


def is_saved_model(payload: object) -> bool:
    """Whether a loaded file is a :func:`save_model` payload (an exported ddpipe model)."""
    return isinstance(payload, dict) and {"state_dict", "model", "classes", "mean", "std"} <= payload.keys()


def load_model(path: str | Path) -> tuple[nn.Module, SavedModel]:
    """The network saved by :func:`save_model` (on the CPU, in eval mode), and the file's fields."""
    saved = SavedModel.from_payload(torch.load(path, map_location="cpu", weights_only=True))
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
