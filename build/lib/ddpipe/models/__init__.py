"""Networks, no process group: ``nets`` (ddpipe's own, and how a network predicts), ``catalog`` (any network by
``model.name``, the renamed names), ``pretrained`` (weights to start from; the training's only), ``finetune`` (the
body and head of a network being fine-tuned), ``saved`` (the saved model file, ``paths.model``), ``served`` (the
classifier as a client calls it: the evaluate stage's predictions and MLflow's pyfunc model). This ``__init__``
imports nothing, so a stage loads only the modules it names (dvc.yaml's deps)."""
