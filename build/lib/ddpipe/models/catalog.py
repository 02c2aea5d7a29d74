"""``model.name`` -> a network: ddpipe's own, any torchvision classification model, a timm model, or a class of
the user's (``module.path:ClassName``). The registry is data (``nets.OWN``, torchvision's and timm's own
registries), not an if-chain.

Every network is built for ``in_channels`` and ``num_classes``: torchvision's and timm's with their own
(ImageNet) stem, its first convolution made for ``in_channels`` when that is not 3, and their classifier
head for ``num_classes``. :func:`classifier_head` finds the head, which fine-tuning and pretrained weights
treat apart from the body.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

from torch import nn

from ddpipe.config.schema import ConfigError, ModelConfig
from ddpipe.models.nets import OWN

# Names that meant ddpipe's small-image variants (a small stem) before torchvision's names were accepted, and what
# those variants are called now: the one table behind the launcher's note, the saved model's refusal and the
# fingerprint that keeps older checkpoints of these names from resuming into torchvision's network.
RENAMED = {"resnet18": "resnet18_cifar", "resnet34": "resnet34_cifar", "resnet50": "resnet50_cifar"}


def torchvision_names() -> list[str]:
    import torchvision

    return torchvision.models.list_models(module=torchvision.models)


def _timm() -> object | None:
    if importlib.util.find_spec("timm") is None:
        return None
    import timm

    return timm


def kind(name: str) -> str:
    """``own``, ``torchvision``, ``timm`` or ``class`` (``module:Class``); ConfigError when the name is none."""
    if ":" in name:
        return "class"
    if name in OWN:
        return "own"
    if name in torchvision_names():
        return "torchvision"
    timm = _timm()
    if timm is not None and timm.is_model(name):
        return "timm"
    import difflib

    close = difflib.get_close_matches(name, [*OWN, *torchvision_names()], n=3)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    timm_hint = "" if timm is not None else " (timm's models too once `pip install timm`)"
    raise ConfigError(f"model.name = {name!r} is not accepted; expected auto, one of ddpipe's ({', '.join(OWN)}), "
                      f"a torchvision classification model (torchvision.models.list_models(): resnet50, "
                      f"efficientnet_b0, ...){timm_hint}, or module.path:ClassName.{hint}")


def build_model(cfg: ModelConfig, num_channels: int, num_classes: int) -> nn.Module:
    """The network named by ``model.name`` for images of ``num_channels`` channels, with fresh weights
    (pretrained ones are ddpipe.models.pretrained's)."""
    how = kind(cfg.name)
    kwargs = dict(cfg.kwargs)
    try:
        if how == "own":
            return OWN[cfg.name](num_channels, num_classes, width=cfg.width, **kwargs)
        if how == "class":
            model = own_class(cfg.name)(in_channels=num_channels, num_classes=num_classes, **kwargs)
            if not isinstance(model, nn.Module):
                raise ConfigError(f"model.name = {cfg.name!r} built a {type(model).__name__}, not a torch.nn.Module")
            return model
        if how == "timm":
            return _timm().create_model(cfg.name, pretrained=False, num_classes=num_classes,  # type: ignore[attr-defined]
                                        in_chans=num_channels, **kwargs)
        import torchvision

        model = torchvision.models.get_model(cfg.name, weights=None, num_classes=num_classes, **kwargs)
    except TypeError as exc:  # a keyword the constructor does not take
        raise ConfigError(f"model.kwargs = {kwargs} is not accepted by model.name = {cfg.name!r}: {exc}") from None
    return adapt_input_channels(model, num_channels)


def own_class(name: str) -> type:
    """The class ``module.path:ClassName`` names, imported with the repository root (the working directory of
    every stage) on ``sys.path``."""
    module_name, _, class_name = name.partition(":")
    root = os.getcwd()
    if root not in sys.path:
        sys.path.insert(0, root)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"model.name = {name!r}: module {module_name!r} cannot be imported from {root} ({exc}); "
                          f"expected a file {module_name.replace('.', '/')}.py or a package of that name at the "
                          "repository root") from None
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        found = sorted(n for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, nn.Module)
                       and v.__module__ == module.__name__)
        raise ConfigError(f"model.name = {name!r}: {module.__file__} has no class {class_name!r}; its networks: "
                          f"{', '.join(found) or 'none'}")
    return cls


def code_paths(name: str) -> list[str]:
    """The file or top-level package that a ``module:Class`` network's code lives in (for MLflow's
    ``code_paths``: the logged model carries it, so it loads from any directory); [] for the others."""
    if ":" not in name:
        return []
    top = name.partition(":")[0].split(".")[0]
    module = sys.modules.get(top) or importlib.import_module(top)
    path = Path(module.__file__)  # type: ignore[arg-type]
    return [str(path.parent if path.name == "__init__.py" else path)]


def module_file(name: str) -> Path | None:
    """For ``module:Class``, the source file (relative to the working directory) that defines the module."""
    if ":" not in name:
        return None
    module_name = name.partition(":")[0]
    for candidate in (Path(*module_name.split(".")).with_suffix(".py"), Path(*module_name.split("."), "__init__.py")):
        if candidate.is_file():
            return candidate
    return None


def adapt_input_channels(model: nn.Module, num_channels: int) -> nn.Module:
    """A 3-channel network's first convolution remade for ``num_channels`` (grey images: 1), fresh weights."""
    if num_channels == 3:
        return model
    name, conv = first_conv(model)
    if conv is None or conv.in_channels == num_channels:
        return model
    new = nn.Conv2d(num_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding, conv.dilation,
                    conv.groups if conv.groups == 1 else num_channels, conv.bias is not None, conv.padding_mode)
    _set_submodule(model, name, new)
    return model


def first_conv(model: nn.Module) -> tuple[str, nn.Conv2d | None]:
    """The first ``Conv2d`` in the network's module order (its stem), and its name."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Conv2d):
            return name, module
    return "", None


def classifier_head(model: nn.Module, num_classes: int) -> str:
    """The name of the layer that makes the ``num_classes`` logits: timm's ``get_classifier()``, else the last
    Linear (or 1x1 Conv2d, as SqueezeNet's) with ``num_classes`` outputs. ValueError when there is none."""
    get = getattr(model, "get_classifier", None)
    head = get() if callable(get) else None
    found = ""
    for name, module in model.named_modules():
        if head is not None and module is head:
            return name
        if isinstance(module, nn.Linear) and module.out_features == num_classes or (
                isinstance(module, nn.Conv2d) and module.out_channels == num_classes and module.kernel_size == (1, 1)):
            found = name
    if not found:
        raise ValueError(f"no classifier head found: no Linear layer with {num_classes} outputs")
    return found


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)
