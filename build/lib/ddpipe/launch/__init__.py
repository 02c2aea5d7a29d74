"""How trainings start: the one torchrun command (``torchrun``, run as ``python -m ddpipe.launch`` and by the train
stage's stages/train.py; each rank runs the module ``worker``), and DVC's queue on a cluster (``cluster``). Nothing
below imports this package."""
