"""The static INT8 copy of an exported graph: ONNX Runtime's ``quantize_static`` in the QDQ format (portable: any
runtime that reads QuantizeLinear/DequantizeLinear), weights quantised per output channel, uint8 activations whose
ranges are calibrated on images of a training split (``export.calibration_split``, never the test split that
checks it).

The weights' type follows the CPU the copy is made for (``export.int8_cpu``; ``ddpipe.models.saved.INT8_WEIGHTS``
says which and why): int8 where the CPU has VNNI, uint8 on x86 without it, whose uint8 x int8 kernels saturate.
What the copy was made for is written into its metadata (``INT8_CPU_KEY``), which the served model compares with
the CPU it runs on."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ddpipe.models.saved import INPUT_NAME, INT8_CPU_KEY, INT8_WEIGHTS

CALIBRATION_BATCH = 32  # images per calibration run: the ranges are the same at any batch, memory is not


def quantize(graph: Path, out: Path, images: Iterator[np.ndarray], cpu: str) -> None:
    """``graph`` as a static INT8 graph ``out`` for CPUs of kind ``cpu`` (a key of :data:`INT8_WEIGHTS`), calibrated
    on the uint8 batches ``images``; its metadata kept, and what it was made for added."""
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

    weights = QuantType.QInt8 if INT8_WEIGHTS[cpu] == "int8" else QuantType.QUInt8
    with tempfile.TemporaryDirectory() as tmp:
        # ONNX Runtime's recommended pre-processing: shapes inferred, BatchNorm folded into the convolutions (else
        # each is quantised apart, and the copy loses accuracy)
        ready = Path(tmp) / "ready.onnx"
        quant_pre_process(str(graph), str(ready), skip_symbolic_shape=True)
        # the probabilities stay fp32: quantised to uint8 they would move in steps of 1/255 and no longer sum to 1
        softmax = [n.name for n in onnx.load(str(ready), load_external_data=False).graph.node if n.op_type == "Softmax"]
        quantize_static(str(ready), str(out), Batches(), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=weights,
                        calibrate_method=CalibrationMethod.MinMax, nodes_to_exclude=softmax)
    source, model = onnx.load(str(graph), load_external_data=False), onnx.load(str(out))
    del model.metadata_props[:]
    model.metadata_props.extend(source.metadata_props)
    model.metadata_props.add(key="quantization", value=f"static INT8, QDQ, per-channel {INT8_WEIGHTS[cpu]} weights, "
                             f"uint8 activations, made for {cpu} CPUs")
    model.metadata_props.add(key=INT8_CPU_KEY, value=cpu)
    onnx.save_model(model, str(out))
