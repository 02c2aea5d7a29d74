"""Pretrained weights (``model.weights``): found, read safely, and fitted to the network being trained.

- Where from: a file under ``paths.pretrained`` (a state dict as torchvision and timm distribute them, a
  checkpoint that wraps one under ``state_dict``/``model``, a ``.safetensors`` file, or a model file exported by
  an earlier ddpipe experiment), or a torchvision weights name (``ResNet50_Weights.IMAGENET1K_V2``), read from
  torch hub's cache (``$TORCH_HOME/hub/checkpoints``) or downloaded there first.
- Read as checkpoints are: ``torch.load(weights_only=True)``. A file that carries pickled objects other than
  tensors and plain containers is refused before anything in it runs (CVE-2025-32434).
- Fitted: a classifier head of another size keeps the network's fresh initialisation; 3-channel weights serve
  1-channel images by summing the stem's filters over their input channels (timm's ``adapt_input_conv``): a grey
  image repeated to RGB gives the original filters exactly that response. Any other mismatch is an error that
  names the keys.
- The input normalisation follows the weights where they state one (torchvision's weights, an exported ddpipe
  model); for grey images the mean and std of the three channels are averaged.
"""

from __future__ import annotations

import hashlib
import importlib.util
import pickle
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
from torch import nn

from ddpipe.config.checks import TORCHVISION_WEIGHTS
from ddpipe.config.schema import ConfigError
from ddpipe.models.catalog import classifier_head, first_conv
from ddpipe.models.saved import is_saved_model


class WeightsError(ConfigError):
    """``model.weights`` names nothing readable, or weights that do not fit the network."""


@dataclass
class Pretrained:
    """Weights read from ``source`` (a file, or a torchvision name and its cache file)."""

    state_dict: dict[str, torch.Tensor]
    source: str
    file: Path
    sha256: str
    mean: list[float] | None = None  # the normalisation the weights were trained with, when stated
    std: list[float] | None = None

    def normalisation(self, num_channels: int) -> tuple[list[float], list[float]] | None:
        """(mean, std) for images of ``num_channels`` channels, or None when the weights state none."""
        if self.mean is None or self.std is None:
            return None
        if len(self.mean) == num_channels:
            return list(self.mean), list(self.std)
        if num_channels == 1:
            return [sum(self.mean) / len(self.mean)], [sum(self.std) / len(self.std)]
        return None


def load_pretrained(spec: str) -> Pretrained:
    """The weights ``model.weights`` names (a torchvision name is downloaded into torch hub's cache first when
    it is not there). WeightsError when they cannot be had or read."""
    if TORCHVISION_WEIGHTS.match(spec):
        file, mean, std = torchvision_weights_file(spec)
        state = read_state_dict(file, spec)
        return Pretrained(state, spec, file, sha256(file), mean, std)
    file = Path(spec)
    if not file.is_file():
        raise WeightsError(f"model.weights = {spec!r}: no such file")
    payload = _read(file, spec)
    if is_saved_model(payload):  # a model exported by an earlier experiment: its normalisation too
        return Pretrained(_tensors(payload["state_dict"], spec), spec, file, sha256(file), list(payload["mean"]),
                          list(payload["std"]))
    return Pretrained(_unwrap(payload, spec), spec, file, sha256(file))


def torchvision_weights_file(name: str) -> tuple[Path, list[float] | None, list[float] | None]:
    """torch hub's cache file of the torchvision weights ``name`` (downloaded when missing), their mean, std."""
    import torchvision

    try:
        weights = torchvision.models.get_weight(name)
    except (ValueError, KeyError, AttributeError) as exc:
        raise WeightsError(f"model.weights = {name!r} is not a torchvision weights name ({exc}); expected e.g. "
                           "ResNet50_Weights.IMAGENET1K_V2 (torchvision.models.get_model_weights('resnet50'))"
                           ) from None
    file = Path(torch.hub.get_dir()) / "checkpoints" / Path(urlparse(weights.url).path).name
    if not file.is_file():
        file.parent.mkdir(parents=True, exist_ok=True)
        try:
            torch.hub.download_url_to_file(weights.url, str(file), progress=False)
        except Exception as exc:  # offline: URLError, a proxy's refusal, a timeout
            raise WeightsError(
                f"model.weights = {name!r}: {file} is not in torch hub's cache and downloading {weights.url} failed "
                f"({type(exc).__name__}: {exc}); without internet, copy that file to {file} (the cache is "
                "$TORCH_HOME/hub/checkpoints, ~/.cache/torch by default)") from None
    preset = weights.transforms()
    return file, list(getattr(preset, "mean", None) or []) or None, list(getattr(preset, "std", None) or []) or None


def read_state_dict(file: Path, spec: str) -> dict[str, torch.Tensor]:
    """The tensors of a state-dict file (``weights_only=True``; ``.safetensors`` with that package)."""
    return _unwrap(_read(file, spec), spec)


def _read(file: Path, spec: str) -> object:
    if file.suffix == ".safetensors":
        if importlib.util.find_spec("safetensors") is None:
            raise WeightsError(f"model.weights = {spec!r}: a .safetensors file needs the safetensors package "
                               "(pip install safetensors, or ddpipe's timm extra)")
        from safetensors.torch import load_file

        return load_file(str(file), device="cpu")
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        unsafe = [ln for ln in lines if "global" in ln.lower() and "weights_only" not in ln]
        if not unsafe:  # not a pickle at all (truncated, another format)
            raise WeightsError(f"model.weights = {spec!r} cannot be read as PyTorch weights: {lines[-1]}") from None
        raise WeightsError(
            f"model.weights = {spec!r} is refused: the file holds pickled objects beyond tensors and plain "
            f"containers, which could run code when loaded (CVE-2025-32434), so it was not loaded ({unsafe[0]}). "
            "Save its state_dict() alone (torch.save(model.state_dict(), path)), or use a .safetensors file") from None
    except (RuntimeError, EOFError, OSError) as exc:
        raise WeightsError(f"model.weights = {spec!r} cannot be read as PyTorch weights: {exc}") from None


def _unwrap(payload: object, spec: str) -> dict[str, torch.Tensor]:
    """The state dict in ``payload``: itself, or under ``state_dict``/``model``/``module`` (training checkpoints)."""
    if isinstance(payload, dict):
        for key in ("state_dict", "model", "module"):
            inner = payload.get(key)
            if isinstance(inner, dict) and inner and all(isinstance(v, torch.Tensor) for v in inner.values()):
                return _tensors(inner, spec)
    return _tensors(payload, spec)


def _tensors(payload: object, spec: str) -> dict[str, torch.Tensor]:
    if not (isinstance(payload, dict) and payload and all(isinstance(v, torch.Tensor) for v in payload.values())):
        raise WeightsError(f"model.weights = {spec!r} holds no state dict (a mapping of parameter names to tensors)")
    state = dict(payload)
    for prefix in ("module.", "_orig_mod."):  # saved from a DDP wrapper or a torch.compile'd module
        if all(k.startswith(prefix) for k in state):
            state = {k[len(prefix):]: v for k, v in state.items()}
    return state


def sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def apply_pretrained(model: nn.Module, pretrained: Pretrained, num_classes: int) -> list[str]:
    """Load ``pretrained`` into ``model`` (in place), its head replaced when of another size and its stem summed
    over RGB for grey images; what was adapted, as lines for the log. WeightsError naming the keys that do
    not fit otherwise."""
    own = model.state_dict()
    head = classifier_head(model, num_classes)
    head_keys = {k for k in own if k.startswith(head + ".")}
    stem_name, _ = first_conv(model)
    fitted: dict[str, torch.Tensor] = {}
    notes, replaced, unexpected, mismatched = [], [], [], []
    for key, value in pretrained.state_dict.items():
        want = own.get(key)
        if want is None:
            unexpected.append(key)
        elif value.shape == want.shape:
            fitted[key] = value
        elif key in head_keys:
            replaced.append(f"{key} {list(value.shape)}")
        elif key == f"{stem_name}.weight" and value.dim() == 4 and value.shape[1] == 3 and want.shape[1] == 1 \
                and value.shape[0] == want.shape[0] and value.shape[2:] == want.shape[2:]:
            fitted[key] = value.sum(1, keepdim=True)
            notes.append(f"stem {stem_name}: 3-channel weights summed over RGB for 1-channel images")
        else:
            mismatched.append(f"{key} {list(value.shape)} (network: {list(want.shape)})")
    missing = [k for k in own if k not in fitted and k not in head_keys and not k.endswith("num_batches_tracked")]
    if unexpected or mismatched or missing:
        parts = [f"{what}: {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''} ({len(keys)})"
                 for what, keys in (("not in the network", unexpected), ("of another shape", mismatched),
                                    ("missing from the file", missing)) if keys]
        raise WeightsError(f"model.weights = {pretrained.source!r} does not fit model.name's network; keys "
                           + "; ".join(parts))
    model.load_state_dict(fitted, strict=False)
    if replaced:
        # Zeros, as MAE/BEiT-style fine-tuning recipes start their new heads (near zero): the first logits are
        # all equal (loss ln K) instead of a random projection of large pretrained features, which a head at a
        # fine-tuning lr takes many steps to undo (measured: BENCHMARKS.md, "Fine-tuning").
        with torch.no_grad():
            for param in model.get_submodule(head).parameters():
                param.zero_()
        notes.append(f"classifier head {head} replaced for {num_classes} classes (the file's: {', '.join(replaced)}): "
                     "zero-initialised")
    return [f"pretrained weights {pretrained.source} (sha256 {pretrained.sha256[:12]}): {len(fitted)} tensors loaded",
            *notes]
