"""The export stage: the trained model as ONNX graphs a client without Python runs, checked before they count.

    graph    the graph: uint8 images in, the training's normalisation, the network, the evaluation's flips,
             probabilities out, class names in its metadata (torch.onnx.export's dynamo exporter, batch dynamic)
    int8     its static INT8 copy (ONNX Runtime's quantize_static, QDQ, per-channel), calibrated on training images
    check    every format scored by ONNX Runtime on the whole test split against the PyTorch model; CPU latency
    stage    the stage itself: checks before work, files staged and put in place only when every format passed,
             metrics/export.json (DVC metrics) beside export_host.json (this host's latencies and load), the MLflow
             run, the registered version and the champion alias

Nothing is imported here.
"""
