"""Networks: ``nets`` (ddpipe's own, and how a network predicts), ``registry`` (any network by ``model.name``),
``saved`` (the saved model file, ``paths.model``), ``pretrained`` (weights to start from; the training's
only). This ``__init__`` imports nothing, so a stage loads only the modules it names (dvc.yaml's deps)."""
