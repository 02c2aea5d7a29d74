"""One training process from a checkout: ``python stages/train_worker.py [key=value ...]`` trains as one plain
process (no process group). The train stage's launcher starts the same code on every rank as a module
(``torchrun ... -m ddpipe.launch.worker``): see ddpipe.launch.worker.
"""

from ddpipe.launch.worker import main

if __name__ == "__main__":
    main()
