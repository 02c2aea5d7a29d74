"""``python -m ddpipe.launch [--print] [key=value ...]``: the train stage's command (ddpipe.launch.torchrun)."""

from ddpipe.launch.torchrun import main

if __name__ == "__main__":
    raise SystemExit(main())
