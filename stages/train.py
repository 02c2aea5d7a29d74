"""DVC stage `train`: check the params, this node and the data, then run torchrun over ddpipe.launch.worker.

    python stages/train.py [key=value ...]            # what dvc.yaml runs (the same as python -m ddpipe.launch)
    python stages/train.py --print [key=value ...]    # the checks and the torchrun command only
"""

from ddpipe.launch.torchrun import main

if __name__ == "__main__":
    raise SystemExit(main(prog="python stages/train.py"))
