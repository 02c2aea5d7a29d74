"""DVC stage `export`: the trained model as ONNX graphs (fp32 and INT8), checked with ONNX Runtime on the test split
against the PyTorch model before they replace the previous export; then the champion alias.

    python stages/export.py [key=value ...]
"""

import logging

from ddpipe.config.command import execute_stage
from ddpipe.config.schema import Config
from ddpipe.data.store import PreparedDataError

logger = logging.getLogger("ddpipe.stages.export")  # under ddpipe's logger, which execute_stage shows


def main(cfg: Config) -> None:
    from ddpipe.export.graph import ExportError
    from ddpipe.export.stage import ExportCheckFailed, export

    try:
        m = export(cfg)["export"]
    except (ExportError, ExportCheckFailed) as exc:
        raise SystemExit(f"error: export: {exc}") from None
    for name in [f for f in ("onnx", "int8") if f in m]:
        timed = [f", {batch} p50 {times['p50']} ms" for batch, times in m[name].get("latency_ms", {}).items()][:1]
        logger.info(f"export: {name}: accuracy {m[name]['accuracy']:.4f}, agreement {m[name]['agreement']:.4%}, size "
                    f"{m[name]['size_mb']:.1f} MB{''.join(timed)} -> {cfg.paths.export_metrics}")


if __name__ == "__main__":
    execute_stage(main, "stages/export.py", (PreparedDataError, FileNotFoundError))
