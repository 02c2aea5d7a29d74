"""Object storage (S3 and what speaks its API: SeaweedFS, MinIO, Garage, a cloud bucket): one home for its URLs, its
endpoint and credentials (from the environment or a caller's settings, never from a file in git), and the check that
names what is wrong before any work starts.

The DVC remote's set-up and check (deploy/object_store.py, ``make remote``) go through here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEME = "s3://"
# The endpoint of an S3-compatible store, as boto3 and the AWS CLI read it (an S3-only one first)
ENDPOINT_ENVS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")


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
