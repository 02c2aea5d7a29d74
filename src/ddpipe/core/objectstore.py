"""Object storage (S3 and what speaks its API: SeaweedFS, MinIO, Garage, a cloud bucket): one home for its URLs, its
endpoint and credentials (from the environment, else the repository's DVC remote on the same bucket, never from a file
in git), the check that names what is wrong before any work starts, retries with backoff, and folders of whole files.

A :class:`Folder` is where whole files are written and read back by name: a directory on this host
(:class:`DiskFolder`: a temp file, fsync, rename) or a prefix in a store (:class:`StoreFolder`, through fsspec: one PUT,
or a multipart upload completed only once every part is in; S3 shows an object whole or not at all, so a reader never
sees a half-written one, and an upload cut by a dead store leaves nothing behind). Training checkpoints
(``paths.checkpoints = s3://...``, ddpipe.engine.checkpoint), the DVC remote's set-up and check
(deploy/object_store.py, ``make remote``) and the tracking server's artifact store (deploy/tracking_server.py) go
through here.

A store that is away is a pause for a training, not its end (issue 69): a checkpoint it does not take is skipped and
the training goes on, its requests tried once each (:func:`tried_once`) until the store is back; only a store away for
:data:`STORE_OUTAGE_S` stops it, with exit code 75 (ddpipe.engine.store_pause).
"""

from __future__ import annotations

import configparser
import contextlib
import contextvars
import io
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, TypeVar

from ddpipe.core.errors import one_line
from ddpipe.core.files import atomic_save

logger = logging.getLogger(__name__)

SCHEME = "s3://"
# The endpoint of an S3-compatible store, as boto3 and the AWS CLI read it (an S3-only one first)
ENDPOINT_ENVS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
# Seconds between the attempts of a store request that failed for a reason that may pass (the store restarting, the
# network): 5 retries, 15.5 s in all, then a StoreError naming the store. A refusal (a wrong key, no bucket) is not
# retried. While a store is known to be away, one attempt (tried_once).
RETRY_DELAYS_S = (0.5, 1.0, 2.0, 4.0, 8.0)
# How long the store of a training's checkpoints may be away (its writes failing past their retries, counted from the
# first that failed) before the training stops for it: until then it trains on, each checkpoint the store does not
# take skipped for the next, and the last one waited for; past it, it stops with exit code 75 (EXIT_PREEMPTED), its
# newest whole checkpoint in the store, for its scheduler to run it again (ddpipe.engine.store_pause). Five minutes: a
# store restarting or a network blip is over well before, and a bucket down for longer is worth the requeue.
STORE_OUTAGE_S = 300.0

T = TypeVar("T")


class StoreError(RuntimeError):
    """What is wrong with a store, in words that name it (no traceback)."""


@dataclass(frozen=True)
class Store:
    """Where objects go: the endpoint (None: AWS's own, or the environment's) and the credentials (None: botocore's
    chain: the environment's AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.aws, an instance role)."""

    endpoint: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None
    region: str | None = None

    @classmethod
    def from_environment(cls) -> Store:
        return cls(endpoint=next((os.environ[n] for n in ENDPOINT_ENVS if os.environ.get(n)), None))

    @classmethod
    def for_url(cls, url: str, roots: tuple[Path, ...] = ()) -> Store:
        """The store of ``url``: the environment's, when it names an endpoint or keys; else the settings of a DVC
        remote on the same bucket in one of ``roots``' .dvc/config and .dvc/config.local (what ``make remote``
        wrote), so that checkpoints go where the team's data goes with nothing more to set; else AWS's chain."""
        env = cls.from_environment()
        if env.endpoint or os.environ.get("AWS_ACCESS_KEY_ID"):
            return env
        bucket, _ = split(url)
        for root in roots:
            for settings in dvc_remotes(root).values():
                if settings.get("url", "").rstrip("/").split("/")[:3] == ["s3:", "", bucket]:
                    return cls(settings.get("endpointurl"), settings.get("access_key_id"),
                               settings.get("secret_access_key"), settings.get("region"))
        return env

    def environment(self) -> dict[str, str]:
        """This store as the environment of a process that reads it with boto3 (``mlflow server``'s artifact proxy):
        the endpoint (MLflow's ``MLFLOW_S3_ENDPOINT_URL``, boto3's ``AWS_ENDPOINT_URL_S3``) and the keys, those set."""
        env = {"MLFLOW_S3_ENDPOINT_URL": self.endpoint, "AWS_ENDPOINT_URL_S3": self.endpoint,
               "AWS_ACCESS_KEY_ID": self.access_key_id, "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
               "AWS_DEFAULT_REGION": self.region}
        return {name: value for name, value in env.items() if value}

    def fsspec_options(self) -> dict[str, Any]:
        """The options of s3fs's filesystem for this store: its endpoint, keys and path-style addressing."""
        options: dict[str, Any] = {"skip_instance_cache": True, "config_kwargs": {
            "s3": {"addressing_style": "path"}, "connect_timeout": 5, "read_timeout": 60,
            "retries": {"max_attempts": 1}}, "client_kwargs": {"region_name": self.region or "us-east-1"}}
        if self.endpoint:
            options["endpoint_url"] = self.endpoint
        if self.access_key_id:
            options |= {"key": self.access_key_id, "secret": self.secret_access_key}
        return options

    def client(self) -> Any:
        """A botocore S3 client: path-style addressing (what S3-compatible stores answer), a short connect timeout,
        one attempt (a check must answer at once)."""
        import botocore.config
        import botocore.session

        session = botocore.session.get_session()
        config = botocore.config.Config(connect_timeout=5, read_timeout=60, retries={"max_attempts": 1},
                                        s3={"addressing_style": "path"})
        return session.create_client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key_id,
                                     aws_secret_access_key=self.secret_access_key,
                                     region_name=self.region or "us-east-1", config=config)


def is_store_url(path: str | Path) -> bool:
    return str(path).startswith(SCHEME)


def dvc_remotes(root: Path) -> dict[str, dict[str, str]]:
    """{name: settings} of the DVC remotes in ``root``'s .dvc/config with .dvc/config.local over it (DVC's INI files
    read as text: no DVC import in a training)."""
    remotes: dict[str, dict[str, str]] = {}
    for name in ("config", "config.local"):
        parser = configparser.ConfigParser(interpolation=None)
        try:
            parser.read(Path(root) / ".dvc" / name)
        except configparser.Error:
            continue
        for section in parser.sections():
            words = section.strip("'").split(None, 1)
            if len(words) == 2 and words[0] == "remote":
                remotes.setdefault(words[1].strip('"'), {}).update(parser[section])
    return remotes


def split(url: str) -> tuple[str, str]:
    """``s3://bucket/key/...`` -> (bucket, key), refused with the URL named when it is not one."""
    if not is_store_url(url) or not url[len(SCHEME):].split("/", 1)[0]:
        raise StoreError(f"{url!r} is not an object store URL; expected s3://BUCKET[/PREFIX]")
    bucket, _, key = url[len(SCHEME):].partition("/")
    return bucket, key


def _unreachable(exc: BaseException) -> bool:
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import ConnectTimeoutError, EndpointConnectionError, ReadTimeoutError

    return isinstance(exc, (BotoConnectionError, EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError))


def check(store: Store, url: str, what: str) -> None:
    """The store answers, takes the credentials and holds the bucket of ``url``; else a :class:`StoreError` naming
    ``what`` (a DVC remote, a setting), the URL and the endpoint, and what to do. One request, no retries: it is
    asked before any work starts."""
    from botocore.exceptions import ClientError, NoCredentialsError

    bucket, _ = split(url)
    where = f"{what} ({url}, endpoint {store.endpoint or 'AWS'})"
    try:
        store.client().head_bucket(Bucket=bucket)
    except NoCredentialsError:
        raise StoreError(f"{where}: no credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or the "
                         "remote's access_key_id and secret_access_key in .dvc/config.local)") from None
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("404", "NoSuchBucket") or status == 404:
            raise StoreError(f"{where}: the store has no bucket {bucket!r} (create it, or correct the URL)") from None
        if code in ("403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied") or status == 403:
            raise StoreError(f"{where}: the store refused the credentials (access key id "
                             f"{store.access_key_id or 'from the environment'!r}: {code or status})") from None
        raise StoreError(f"{where}: {code or status}: {exc}") from None
    except Exception as exc:
        if _unreachable(exc):
            raise StoreError(f"{where}: the store does not answer ({exc}); is it running? (`make remote` starts a "
                             "local one)") from None
        raise


# ---------------------------------------------------------------------------------------------
# Requests that retry, and folders of whole files


# Set within tried_once: this thread's store requests are tried once each (a store known to be away)
_TRIED_ONCE: contextvars.ContextVar[bool] = contextvars.ContextVar("ddpipe_store_tried_once", default=False)


@contextlib.contextmanager
def tried_once() -> Iterator[None]:
    """Within: each request of this thread that :func:`retried` makes is tried once, without backoff. For a store
    known to be away: a training asks it again at its next checkpoint instead of waiting 15.5 s at each."""
    token = _TRIED_ONCE.set(True)
    try:
        yield
    finally:
        _TRIED_ONCE.reset(token)


def retried(action: Callable[[], T], what: str, delays: tuple[float, ...] | None = None) -> T:
    """``action()``, tried again after each of ``delays`` (None: :data:`RETRY_DELAYS_S`; within :func:`tried_once`,
    none) while it fails for a reason that may pass; a :class:`StoreError` naming ``what`` when the last attempt fails.
    Each kind of failure is said once on stderr, not each attempt. A missing object (FileNotFoundError) and a refusal
    (PermissionError: s3fs's word for a 403) are not retried: they do not pass."""
    delays = () if _TRIED_ONCE.get() else RETRY_DELAYS_S if delays is None else delays
    said: set[str] = set()
    for attempt, delay in enumerate((*delays, None), start=1):
        try:
            return action()
        except (FileNotFoundError, PermissionError, StoreError):
            raise
        except Exception as exc:
            if delay is None:
                times = "once" if attempt == 1 else f"{attempt} times over {sum(delays):.1f} s"
                raise StoreError(f"{what}: failed {times}; the last time: {one_line(exc, 300)}") from None
            if type(exc).__name__ not in said:
                said.add(type(exc).__name__)
                left = delays[attempt - 1:]
                logger.warning(f"warning: {what}: {one_line(exc, 200)}; trying again {len(left)} more time(s) over "
                               f"{sum(left):g} s")
            time.sleep(delay)
    raise AssertionError("unreachable")


class Folder(Protocol):
    """Whole files by name, on a disk or in a store."""

    where: str

    def names(self) -> list[str]: ...
    def write(self, name: str, write: Callable[[IO[bytes]], None]) -> str | Path: ...
    def read(self, name: str) -> bytes: ...
    def remove(self, name: str) -> None: ...


class DiskFolder:
    """A directory of this host: each file written to a temp file beside it, fsynced and renamed onto its name."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.where = str(self.directory)

    def names(self) -> list[str]:
        return [p.name for p in self.directory.iterdir() if p.is_file()] if self.directory.is_dir() else []

    def write(self, name: str, write: Callable[[IO[bytes]], None]) -> Path:
        atomic_save(self.directory / name, write)
        return self.directory / name

    def read(self, name: str) -> bytes:
        return (self.directory / name).read_bytes()

    def remove(self, name: str) -> None:
        (self.directory / name).unlink(missing_ok=True)


class StoreFolder:
    """A prefix in a store (``s3://BUCKET/PREFIX``), through fsspec: each file one object, written whole (one PUT, or a
    multipart upload completed once all its parts are in) or not at all; every request retried (:func:`retried`), or
    tried once within :func:`tried_once`."""

    def __init__(self, url: str, store: Store) -> None:
        import fsspec

        split(url)  # refused, naming it, when it is not a store URL
        self.where, self.store = url.rstrip("/"), store
        self.fs = fsspec.filesystem("s3", **store.fsspec_options())
        self.prefix = self.where[len(SCHEME):]

    def _what(self, doing: str) -> str:
        return f"{doing} {self.where} (endpoint {self.store.endpoint or 'AWS'})"

    def names(self) -> list[str]:
        def listing() -> list[str]:
            self.fs.invalidate_cache()
            try:
                return [entry.rsplit("/", 1)[-1] for entry in self.fs.ls(self.prefix, detail=False)]
            except FileNotFoundError:
                return []
        return retried(listing, self._what("listing"))

    def write(self, name: str, write: Callable[[IO[bytes]], None]) -> str:
        buffer = io.BytesIO()
        write(buffer)
        data = buffer.getvalue()
        retried(lambda: self.fs.pipe_file(f"{self.prefix}/{name}", data), self._what(f"writing {name} to"))
        return f"{self.where}/{name}"

    def read(self, name: str) -> bytes:
        return retried(lambda: self.fs.cat_file(f"{self.prefix}/{name}"), self._what(f"reading {name} from"))

    def remove(self, name: str) -> None:
        try:
            retried(lambda: self.fs.rm_file(f"{self.prefix}/{name}"), self._what(f"removing {name} from"))
        except FileNotFoundError:
            pass


def folder(where: str | Path, roots: tuple[Path, ...] = ()) -> Folder:
    """The folder ``where`` names: a store's for an ``s3://`` URL (its store found by :meth:`Store.for_url` in
    ``roots``), else a directory of this host."""
    if is_store_url(where):
        return StoreFolder(str(where), Store.for_url(str(where), roots))
    if "://" in str(where):
        raise StoreError(f"{where!r}: only s3:// URLs (S3 and the stores that speak its API) or a directory of this "
                         "host are accepted")
    return DiskFolder(where)
