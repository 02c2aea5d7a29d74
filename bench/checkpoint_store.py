"""A checkpoint's save and load time on this host's disk against an object store (SeaweedFS's S3 API on 127.0.0.1, as
`make remote` starts it), through ddpipe.engine.checkpoint as a training calls it: the network's weights, AdamW's two
moments and the RNG states, written whole (the disk: temp file, fsync, rename; the store: one PUT, or a multipart upload
completed at the end), then the keep-N pruning; loading the newest back.

    python bench/checkpoint_store.py [--repeats 5]

Two sizes: the default network of params.yaml (resnet_compact at width 16) and torchvision's ResNet-50 (25.6 M
parameters), so the fixed cost of a request and the cost per byte both show.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

import torch
import torchvision
from common import markdown_table, print_machine, summary, temp_dir

from ddpipe.core.objectstore import Store, StoreFolder
from ddpipe.engine import checkpoint as ckpt
from ddpipe.models.nets import ResNetCompact


def state_of(network: torch.nn.Module) -> dict:
    """What a training checkpoints for ``network``: its weights and AdamW's state after one step, the RNGs."""
    optimizer = torch.optim.AdamW(network.parameters(), lr=1e-3)
    for p in network.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    return {"model": network.state_dict(), "optimizer": optimizer.state_dict(), "rng": ckpt.rng_state()}


def timed(action, repeats: int) -> tuple[float, float, float]:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        seconds.append(time.perf_counter() - start)
    return summary(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print_machine()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from deploy.object_store import credentials, start, state, stop
    from tests.conftest import free_port

    networks = {"resnet_compact, width 16 (the default)": ResNetCompact(in_channels=1, num_classes=10, width=16),
                "torchvision resnet50": torchvision.models.resnet50(num_classes=1000)}
    rows = []
    with temp_dir("ckpt-store-") as tmp:
        start(tmp / "store", free_port(), "ddpipe")
        try:
            keys, endpoint = credentials(tmp / "store"), state(tmp / "store")["endpoint"]
            store = Store(endpoint, keys["access_key_id"], keys["secret_access_key"])
            for name, network in networks.items():
                state_ = state_of(network)
                places = {"local disk": tmp / "disk", "object store (127.0.0.1)": StoreFolder(
                    f"s3://ddpipe/bench/{len(rows)}", store)}
                for where, place in places.items():
                    step = iter(range(10**6))
                    save = timed(lambda place=place, step=step, state_=state_: ckpt.save_checkpoint(
                        place, "abcdef012345", ckpt.Position(0, next(step)), state_, keep=2), args.repeats)
                    load = timed(lambda place=place: ckpt.load_latest(place, "abcdef012345"), args.repeats)
                    buffer = io.BytesIO()
                    torch.save(state_, buffer)
                    size = buffer.tell()
                    rows.append((name, where, f"{size / 2**20:.1f} MiB", *(f"{v:.3f}" for v in save),
                                 *(f"{v:.3f}" for v in load)))
                    print(rows[-1], flush=True)
        finally:
            stop(tmp / "store")
    print(markdown_table(("network", "where", "checkpoint", "save s (median)", "min", "max", "load s (median)", "min",
                          "max"), rows))


if __name__ == "__main__":
    main()
