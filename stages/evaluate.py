"""DVC stage `evaluate`: test-split metrics and plots for the trained model, logged to its MLflow run.

    python stages/evaluate.py [key=value ...]
"""

import logging

from ddpipe.config.command import execute_stage
from ddpipe.config.schema import Config
from ddpipe.data.store import PreparedDataError

logger = logging.getLogger("ddpipe.stages.evaluate")  # under ddpipe's logger, which execute_stage shows


def main(cfg: Config) -> None:
    from ddpipe.engine.evaluation import evaluate

    test = evaluate(cfg)["test"]
    logger.info(f"test accuracy {test['accuracy']:.4f}, loss {test['loss']:.4f}, macro-F1 {test['macro_f1']:.4f} "
                f"on {test['num_samples']} images -> {cfg.paths.test_metrics}")


if __name__ == "__main__":
    execute_stage(main, "stages/evaluate.py", (PreparedDataError, FileNotFoundError))
