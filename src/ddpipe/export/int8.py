"""The static INT8 copy of an exported graph: ONNX Runtime's ``quantize_static`` in the QDQ format (portable: any
runtime that reads QuantizeLinear/DequantizeLinear), int8 weights per output channel, uint8 activations whose
ranges are calibrated on images of a training split (``export.calibration_split``, never the test split that
checks it)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ddpipe.models.saved import INPUT_NAME

CALIBRATION_BATCH = 32  # images per calibration run: the ranges are the same at any batch, memory is not


def quantize(graph: Path, out: Path, images: Iterator[np.ndarray]) -> None:
    """``graph`` as a static INT8 graph ``out``, calibrated on the uint8 batches ``images``; its metadata kept."""
    import onnx
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Batches(CalibrationDataReader):
        def get_next(self) -> dict[str, np.ndarray] | None:
            batch = next(images, None)
            return None if batch is None else {INPUT_NAME: batch}

    with tempfile.TemporaryDirectory() as tmp:
        # ONNX Runtime's recommended pre-processing: shapes inferred, BatchNorm folded into the convolutions (else
        # each is quantised apart, and the copy loses accuracy)
        ready = Path(tmp) / "ready.onnx"
        quant_pre_process(str(graph), str(ready), skip_symbolic_shape=True)
        # the probabilities stay fp32: quantised to uint8 they would move in steps of 1/255 and no longer sum to 1
        softmax = [n.name for n in onnx.load(str(ready), load_external_data=False).graph.node if n.op_type == "Softmax"]
        quantize_static(str(ready), str(out), Batches(), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        calibrate_method=CalibrationMethod.MinMax, nodes_to_exclude=softmax)
    source, model = onnx.load(str(graph), load_external_data=False), onnx.load(str(out))
    del model.metadata_props[:]
    model.metadata_props.extend(source.metadata_props)
    model.metadata_props.add(key="quantization", value="static INT8, QDQ, per-channel int8 weights, uint8 activations")
    onnx.save_model(model, str(out))
