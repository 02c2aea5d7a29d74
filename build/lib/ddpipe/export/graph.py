"""The exported graph: one input (a batch of raw uint8 images at the size the evaluate stage feeds the network,
``N x C x H x W``), the normalisation and the evaluation's test-time flips inside, the class probabilities out,
the class names and the input's description in the model's metadata (``ddpipe.models.saved.onnx_metadata``).

Exported with ``torch.onnx.export(dynamo=True)``; the batch dimension is declared dynamic and checked to have come
out so (pytorch#157621: a dynamic batch exported as a fixed one). A network the exporter refuses fails with the
operator or layer it named.
"""

from __future__ import annotations

import copy
import re
import warnings
from pathlib import Path

import torch
from torch import nn

from ddpipe.models.nets import global_pools_as_reductions
from ddpipe.models.saved import INPUT_NAME, OUTPUT_NAME, SavedModel, onnx_metadata


class ExportError(RuntimeError):
    """The exporter refused the network, or wrote a graph that is not what was asked."""


class ExportedClassifier(nn.Module):
    """uint8 images -> probabilities, as the evaluate stage predicts (``ddpipe.models.nets.predict_logits``). The
    flipped copy goes through the network in the same batch, so the graph holds its weights once (called twice, an
    optimiser that folds BatchNorm per call would store them twice)."""

    def __init__(self, network: nn.Module, saved: SavedModel) -> None:
        super().__init__()
        self.network, self.flips = network.eval(), saved.model.eval_flips
        mean = torch.tensor(saved.mean, dtype=torch.float32).view(1, -1, 1, 1)
        std = torch.tensor(saved.std, dtype=torch.float32).view(1, -1, 1, 1)
        self.register_buffer("scale", 1.0 / (255.0 * std))  # BatchTransform's normalisation, in the same order
        self.register_buffer("shift", -mean / std)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.float() * self.scale + self.shift
        if not self.flips:
            return torch.softmax(self.network(x).float(), dim=1)
        logits = self.network(torch.cat([x, x.flip(-1)])).float()
        pair = logits.view(2, images.shape[0], -1)
        return torch.softmax((pair[0] + pair[1]) / 2, dim=1)


def exportable(network: nn.Module) -> nn.Module:
    """A copy of ``network`` with the layers the exporter may refuse replaced by ones that compute the same forward:
    global max pooling as a reduction, which every exporter translates (ONNX ReduceMax); torch 2.11's dynamo exporter
    has no translation of ``aten.adaptive_max_pool2d`` itself, and resnet_small and resnet_compact end with one. The
    weights, and the network the caller holds, unchanged."""
    return global_pools_as_reductions(copy.deepcopy(network), average=False)


def export_onnx(network: nn.Module, saved: SavedModel, path: Path, opset: int) -> None:
    """``network`` (the saved model's, on the CPU) as the graph ``path``; ExportError naming what the exporter refused,
    or saying that the batch did not come out dynamic."""
    import onnx

    wrapped = ExportedClassifier(exportable(network), saved).eval()
    example = torch.zeros(2, saved.num_channels, *saved.image_size, dtype=torch.uint8)  # 2: a 1 would be specialised
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                wrapped, (example,), dynamo=True, opset_version=opset, input_names=[INPUT_NAME],
                output_names=[OUTPUT_NAME], dynamic_shapes={INPUT_NAME: {0: torch.export.Dim("batch")}},
                verbose=False)
    except Exception as exc:  # torch.export's and the ONNX translator's errors: many kinds, one message here
        raise ExportError(refusal(saved.model.name, exc)) from exc
    model = program.model_proto
    dim = model.graph.input[0].type.tensor_type.shape.dim[0]
    if not dim.dim_param:
        raise ExportError(f"model.name = {saved.model.name!r}: the exporter fixed the batch dimension at "
                          f"{dim.dim_value} (pytorch#157621); the export would take only that batch size")
    del model.metadata_props[:]
    for key, value in onnx_metadata(saved).items():
        model.metadata_props.add(key=key, value=value)
    onnx.save_model(model, str(path))


_OPERATOR = re.compile(r"(aten[.:]{1,2}[\w.]+|[\w]+::[\w.]+|torch\.ops\.[\w.]+)")


def refusal(network: str, exc: BaseException) -> str:
    """What the exporter refused, in one line: the operator it names (``aten::...``, ``namespace::op``), else its
    message's first line."""
    text = f"{exc}\n{exc.__cause__ or ''}"
    found = _OPERATOR.search(text)
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    what = f"the operator {found.group(1)}" if found else "the network"
    return (f"model.name = {network!r}: torch.onnx.export (dynamo) refused {what}: {first[:300]}. Nothing was "
            "written; a network of your own can replace that layer with operators ONNX has (docs/export.md)")
