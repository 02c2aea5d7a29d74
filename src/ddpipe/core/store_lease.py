"""One training per checkpoint place in an object store (``paths.checkpoints = s3://...``), where there is no flock
(ddpipe.core.claims holds a host's directories): a lease, held by the training's global rank 0.

The lease names its holder (host, pid, start time, role, token: a :class:`~ddpipe.core.claims.Holder`) and counts a
beat up at each renewal, so that each write of it is a new version (a new ETag). Whether the store honours S3's
conditional writes is tried at each take, on a scratch object (SeaweedFS, MinIO and AWS S3 do: docs/cluster.md).

Where it does, the lease is one object, :data:`LEASE_NAME`: created with ``If-None-Match: *``, a lapsed one replaced
with ``If-Match: <the ETag read>``, renewed with ``If-Match: <the ETag of the holder's last write>``. Of writers at once
the store lets one through and refuses the others (412): two trainings never both hold it, and a holder whose lease
was replaced learns it at its next renewal.

Where it does not, each training writes only an object of its own, its claim (``<LEASE_NAME>.claim-<token>``), so that
nobody's write can undo another's: a taker writes its claim, then lists the claims; it holds the place if it sees no
other live claim (of two takers, the later writer sees the earlier's claim: S3's writes and listings are strongly
consistent) and marks its claim so, with a generation one above any it saw; otherwise it removes its claim and is
refused, or, when the others were only taking it too, tries again after a random wait. A holder renews its claim only
while the claim has not lapsed and no live claim of a later generation holds the place.

A lease or claim is live while its holder runs (on this host, checked) or the store wrote it less than
:data:`LEASE_TTL_S` ago by the store's own clock (the ``Date`` of the store's answer minus the object's
``Last-Modified``): no host's clock is ever compared with another's. The holder renews it every :data:`LEASE_RENEW_S`
from a thread of its own, whatever the training does, and once more before each checkpoint it writes
(:meth:`StoreLease.check`, through ddpipe.engine.checkpoint.save_checkpoint), which raises :class:`LeaseLost` naming the
new holder once it was taken over: a training frozen (SIGSTOP, a suspended VM) or cut off from the store past the
lease's time writes nothing once it runs again. Not covered: a freeze between that check and the write that follows it
(milliseconds); S3 has no write conditional on another object.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from email.utils import parsedate_to_datetime
from typing import Any

from ddpipe.core.claims import Holder, InUse
from ddpipe.core.objectstore import StoreError, StoreFolder, retried, split, tried_once
from ddpipe.core.processes import alive

logger = logging.getLogger(__name__)

# The lease (in the checkpoints' prefix; its name is no checkpoint's): renewed every LEASE_RENEW_S by its holder (and
# before each checkpoint); one that the store last wrote LEASE_TTL_S ago or more, by the store's clock, has lapsed (its
# training is frozen, cut off, or gone with its host) and may be taken over. Only on a store that ignores conditional
# writes: takers that met at the same moment try again up to LEASE_TRIES times, each after a random wait of up to
# LEASE_BACKOFF_S.
LEASE_NAME, LEASE_RENEW_S, LEASE_TTL_S = "ddpipe-training.lease.json", 15.0, 90.0
LEASE_TRIES, LEASE_BACKOFF_S = 5, 1.0


class LeaseLost(RuntimeError):
    """The store's lease this training held was taken over by another one: this one must write nothing more there.
    Not an :class:`~ddpipe.core.claims.InUse` (a refusal before any work): it comes in the middle of a training."""


@dataclass(frozen=True)
class _Seen:
    """A lease object (or a claim) as one read found it: its key, its holder (None: not a lease of ours), its version
    (the ETag a conditional write names), its age by the store's clock (None: the store sent no time), and, for a
    claim, whether it holds the place and its generation."""

    key: str
    holder: Holder | None
    etag: str
    age_s: float | None
    holds: bool = True
    generation: int = 0


# The leases this process holds, by their place's URL: what a writer there checks before each write (lease_on)
_HELD: dict[str, StoreLease] = {}


def lease_on(where: str) -> StoreLease | None:
    """The lease this process holds on the store's place ``where`` (its URL), if any."""
    return _HELD.get(where.rstrip("/"))


class StoreLease:
    """This training's lease on ``place`` (a prefix in a store): :meth:`take` it, :meth:`check` it before each write
    there, :meth:`release` it at the end. The protocol: this module's docstring."""

    def __init__(self, place: StoreFolder, label: str, me: Holder) -> None:
        self.place, self.label, self.me = place, label, me
        self.store = _Objects(place)
        self.claim_key = f"{self.store.key}.claim-{me.token}"  # this training's claim, where conditions are ignored
        self.conditional = False  # whether the store honours conditional writes (tried at take)
        self._etag, self._beat, self._generation = "", 0, 0  # this holder's last write of the lease
        self._lost: str | None = None  # why, once the lease is known to be another's
        self._lock = threading.Lock()  # one renewal at a time: the thread's, or check()'s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def take(cls, place: StoreFolder, label: str, role: str, say: Callable[[str], None] | None = None) -> StoreLease:
        """The lease on ``place``, or :class:`~ddpipe.core.claims.InUse` naming the training that holds it. One that
        lapsed (by the store's clock), or whose holder on this host has ended, is taken over, saying so through
        ``say``."""
        say = say or logger.info
        lease = cls(place, label, Holder.this(role, uuid.uuid4().hex))
        lease.conditional = lease.store.honours_conditions(lease.me.token)
        if not lease.conditional:
            say(f"note: the store of {place.where} ignores conditional writes (If-None-Match, If-Match): its lease is "
                "a claim object per training (docs/cluster.md)")
        lapsed = lease._take_object() if lease.conditional else lease._take_claim()
        if lapsed is not None:
            age = "" if lapsed.age_s is None else f", last renewed {lapsed.age_s:.0f} s ago by the store's clock"
            say(f"note: taking over {place.where} ({label}) from a training that ended without releasing it "
                f"({lapsed.holder or 'a lease ddpipe did not write'}{age})")
        _HELD[place.where] = lease
        lease._thread = threading.Thread(target=lease._renew, name="ddpipe-store-lease", daemon=True)
        lease._thread.start()
        return lease

    def check(self) -> None:
        """Before a write to the place: renew the lease now, so that it is this training's, by the store's word, for
        :data:`LEASE_TTL_S` more; else :class:`LeaseLost`, naming who holds it now. It asks the store every time: a
        frozen process's renewing thread was frozen too, and has not noticed yet."""
        with self._lock:
            self._renew_once()
        if self._lost is not None:
            raise LeaseLost(self._lost)

    def release(self) -> None:
        """Stop renewing, and remove the lease if it is still this training's (renewed first, which proves it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=LEASE_RENEW_S + 30)
        if _HELD.get(self.place.where) is self:
            del _HELD[self.place.where]
        with contextlib.suppress(Exception), self._lock:
            self._renew_once()  # a takeover needs LEASE_TTL_S after this: none comes before the removal
            if not self.conditional:
                self.store.delete(self.claim_key)  # this training's own, whatever happened
            elif self._lost is None:
                self.store.delete(self.store.key)

    # -- the lease as one object, written conditionally ------------------------------------------------------------

    def _take_object(self) -> _Seen | None:
        """Take the lease object (the store honours conditional writes): the lapsed lease taken over, if any."""
        held = self.store.read(self.store.key)
        if held is not None and _live(held):
            raise InUse(self._refusal(held))
        condition = {"IfMatch": held.etag} if held is not None else {"IfNoneMatch": "*"}
        if (etag := self.store.put(self.store.key, self._body(1), **condition)) is None:  # another writer came first
            now = self.store.read(self.store.key)
            raise InUse(self._refusal(now) if now is not None and now.holder is not None else
                        f"{self.place.where} ({self.label}): another training took it at the same moment and let it "
                        "go; run the command again")
        self._etag, self._beat = etag, 1
        return held

    def _renew_object(self) -> _Seen | None | bool:
        """Renew the lease object: True, or what the place holds now (None: nothing) when it is another's."""
        beat, key = self._beat + 1, self.store.key
        etag = self.store.put(key, self._body(beat), IfMatch=self._etag)
        if etag is None and self._mine(seen := self.store.read(key)):  # our last write went in, its answer was lost
            etag = self.store.put(key, self._body(beat), IfMatch=seen.etag)  # type: ignore[union-attr]
        if etag is None:
            return self.store.read(key)
        self._etag, self._beat = etag, beat
        return True

    # -- a claim per training, where the store ignores conditional writes ------------------------------------------

    def _take_claim(self) -> _Seen | None:
        """Take the place by a claim of this training's own: the lapsed holder taken over, if any."""
        for attempt in range(LEASE_TRIES):
            self.store.put(self.claim_key, self._body(1, holds=False))
            others = self.store.claims(besides=self.claim_key)
            if not (live := [seen for seen in others if _live(seen)]):
                self._generation = max((seen.generation for seen in others), default=0) + 1
                self.store.put(self.claim_key, self._body(1))
                for seen in others:  # lapsed or unreadable: tidied away (a holder that comes back finds its gone)
                    self.store.delete(seen.key)
                self._beat = 1
                return next((seen for seen in others if seen.holds), None)
            self.store.delete(self.claim_key)
            holding = [seen for seen in live if seen.holds]
            if holding or attempt == LEASE_TRIES - 1:
                raise InUse(self._refusal(holding[0]) if holding else
                            f"{self.place.where} ({self.label}): other trainings are taking it at this moment "
                            f"({', '.join(str(seen.holder) for seen in live)}); run the command again")
            time.sleep(random.uniform(0.1, 1.0) * LEASE_BACKOFF_S)  # all were taking it: again, at odds
        raise AssertionError("unreachable")

    def _renew_claim(self) -> _Seen | None | bool:
        """Renew this training's claim: True, or what holds the place now (None: nothing) when the claim lapsed or a
        later generation holds the place."""
        mine, others = self.store.read(self.claim_key), self.store.claims(besides=self.claim_key)
        later = [seen for seen in others if seen.holds and seen.generation > self._generation and _live(seen)]
        lapsed = mine is None or (mine.age_s is not None and mine.age_s >= LEASE_TTL_S - LEASE_RENEW_S)
        if later or lapsed:  # a lapsed claim is given up even if nobody took over: renewing it could undo a takeover
            return later[0] if later else next((s for s in others if s.holds and _live(s)), None)
        self.store.put(self.claim_key, self._body(self._beat + 1))
        self._beat += 1
        return True

    # -- both ------------------------------------------------------------------------------------------------------

    def _renew_once(self) -> None:
        """Renew the lease if it is still this training's; else note who holds it now (``_lost``). Under ``_lock``."""
        if self._lost is not None:
            return
        now = self._renew_object() if self.conditional else self._renew_claim()
        if now is True:
            return
        who = f"another training holds it now: {now.holder}" if isinstance(now, _Seen) and now.holder else \
            "nobody holds it now"
        self._lost = (f"{self.place.where} ({self.label}) is no longer this training's: {who}. Its lease lapsed (this "
                      f"training was stopped, or cut off from the store, for about {LEASE_TTL_S:g} s or more); this "
                      "training stops without writing anything more there (two trainings on one checkpoint place "
                      "would overwrite each other's checkpoints)")

    def _renew(self) -> None:
        failing = False
        while not self._stop.wait(LEASE_RENEW_S) and self._lost is None:
            try:  # once a beat, without the store's backoff: a failed beat is tried again at the next, and check()
                with tried_once(), self._lock:  # (which waits for this lock) is not held up by an outage
                    self._renew_once()
            except Exception as exc:
                if not failing:
                    logger.warning(f"warning: could not renew the lease on {self.place.where} ({exc}); trying again "
                                   f"every {LEASE_RENEW_S:g} s")
                failing = True
                continue
            failing = False
            if self._lost is not None:  # the training learns it at its next checkpoint (check), and stops there
                logger.warning(f"warning: {self._lost}; it stops at its next checkpoint")

    def _body(self, beat: int, holds: bool = True) -> bytes:
        return json.dumps({"holder": asdict(self.me), "beat": beat, "holds": holds,
                           "generation": self._generation}).encode()

    def _mine(self, seen: _Seen | None) -> bool:
        return seen is not None and seen.holder is not None and seen.holder.token == self.me.token

    def _refusal(self, seen: _Seen) -> str:
        head = (f"{self.place.where} ({self.label}) is in use by another training: {seen.holder}"
                + ("" if seen.age_s is None else f", its lease renewed {seen.age_s:.0f} s ago")
                + ". Two trainings on one checkpoint place would overwrite each other's checkpoints: wait for it to "
                "end, or stop it")
        if seen.holder is None or seen.holder.here():
            return head
        if seen.age_s is None:
            return head + (f" (the store sends no time, so its lease never lapses: if it is gone with its host, remove "
                           f"{self.place.where}/{seen.key.rsplit('/', 1)[-1]})")
        return head + (f" (if it is gone with its host, its lease lapses {max(0.0, LEASE_TTL_S - seen.age_s):.0f} s "
                       "from now)")


class _Objects:
    """The lease's objects in the store, under the place's prefix: read with their age by the store's clock, written
    under S3's conditions, listed; each request retried as every store request is (ddpipe.core.objectstore.retried)."""

    def __init__(self, place: StoreFolder) -> None:
        self.where = place.where
        self.bucket, prefix = split(place.where)
        self.key = f"{prefix}/{LEASE_NAME}" if prefix else LEASE_NAME
        self.client = _conditional_client(place.store.client())

    def read(self, key: str) -> _Seen | None:
        """The object ``key`` (the lease, or a claim) as it is now; None when there is none."""
        answer = _request(lambda: self.client.get_object(Bucket=self.bucket, Key=key), self._what("reading", key),
                          absent=(404,))
        if answer is None:
            return None
        try:
            record = json.loads(answer["Body"].read())
            return _Seen(key, Holder(**record["holder"]), answer["ETag"], _store_age_s(answer),
                         bool(record.get("holds", True)), int(record.get("generation", 0)))
        except (ValueError, TypeError, KeyError, AttributeError):  # not a lease of ours (or one cut short): a dead one
            return _Seen(key, None, answer["ETag"], _store_age_s(answer))

    def put(self, key: str, body: bytes, **condition: str) -> str | None:
        """PUT ``body`` at ``key`` under ``condition`` (``IfNoneMatch``/``IfMatch``): its ETag, or None when the store
        refused the condition (412; 409: another conditional write at that moment; 404: If-Match on no object)."""
        refused = (409, 412, *((404,) if "IfMatch" in condition else ()))
        answer = _request(lambda: self.client.put_object(Bucket=self.bucket, Key=key, Body=body, **condition),
                          self._what("writing", key), absent=refused)
        return None if answer is None else str(answer["ETag"])

    def delete(self, key: str) -> None:
        _request(lambda: self.client.delete_object(Bucket=self.bucket, Key=key), self._what("removing", key),
                 absent=(404,))

    def claims(self, besides: str) -> list[_Seen]:
        """The trainings' claims on the place (where the store ignores conditional writes), ``besides`` apart."""
        listing = _request(lambda: self.client.list_objects_v2(Bucket=self.bucket, Prefix=f"{self.key}.claim-"),
                           f"listing the claims on {self.where}")
        keys = [item["Key"] for item in listing.get("Contents", []) if item["Key"] != besides]
        return [seen for key in keys if (seen := self.read(key)) is not None]

    def honours_conditions(self, token: str) -> bool:
        """Whether the store honours S3's conditional writes, tried on a scratch object of ``token``'s: created with
        ``If-None-Match: *``, then written again with that header, and with ``If-Match`` naming a version it never
        had; both must be refused (412). A store that refuses the headers themselves (400, 501) does not honour
        them either."""
        key = f"{self.key}.probe-{token}"
        try:
            created = self.put(key, b"probe", IfNoneMatch="*")
            return created is not None and self.put(key, b"probe", IfNoneMatch="*") is None and \
                self.put(key, b"probe", IfMatch='"00000000000000000000000000000000"') is None
        except _Unsupported:
            return False
        finally:
            with contextlib.suppress(Exception):
                self.delete(key)

    def _what(self, doing: str, key: str) -> str:
        return f"{doing} {key.rsplit('/', 1)[-1]} in {self.where}"


def _live(seen: _Seen) -> bool:
    """Whether the lease or claim ``seen`` holds: its holder runs (on this host), or the store wrote it within the
    lease's time (another host's, judged by the store's clock alone)."""
    if seen.holder is None:
        return False
    if seen.holder.here():
        return alive(seen.holder.pid, seen.holder.started)
    return seen.age_s is None or seen.age_s < LEASE_TTL_S


def _store_age_s(answer: dict[str, Any]) -> float | None:
    """How long ago the store wrote the object of ``answer`` (a GET's), by the store's clock: its ``Date`` header minus
    the object's ``Last-Modified`` (both to the second); None when the store sends no ``Date``."""
    date = answer.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    if not date or answer.get("LastModified") is None:
        return None
    return (parsedate_to_datetime(date) - answer["LastModified"]).total_seconds()


class _Unsupported(StoreError):
    """The store refused a request's headers (400, 501): a conditional write it does not know."""


def _request(call: Callable[[], Any], what: str, absent: tuple[int, ...] = ()) -> Any:
    """``call()`` (a botocore request), retried while it fails for a reason that may pass; None when the store answers
    with a status of ``absent``; any other refusal a StoreError naming ``what``, not retried."""
    from botocore.exceptions import ClientError

    def once() -> Any:
        try:
            return call()
        except ClientError as exc:
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            code = exc.response.get("Error", {}).get("Code", "")
            if status in absent:
                return None
            if status in (400, 501) or code == "NotImplemented":
                raise _Unsupported(f"{what}: {code or status}") from None
            if 400 <= status < 500:
                raise StoreError(f"{what}: {code or status}: {exc}") from None
            raise
    return retried(once, what)


def _conditional_client(client: Any) -> Any:
    """``client`` (botocore's S3), its put_object taking ``IfNoneMatch`` and ``IfMatch``: botocore's own parameters
    (1.36 and later), else sent as the ``If-None-Match``/``If-Match`` headers through the client's events."""
    members = client.meta.service_model.operation_model("PutObject").input_shape.members
    if "IfMatch" in members and "IfNoneMatch" in members:
        return client

    def keep(params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        context["ddpipe_conditions"] = {header: params.pop(name) for name, header in
                                        (("IfMatch", "If-Match"), ("IfNoneMatch", "If-None-Match")) if name in params}

    def send(params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        params["headers"].update(context.get("ddpipe_conditions", {}))

    client.meta.events.register("before-parameter-build.s3.PutObject", keep)
    client.meta.events.register("before-call.s3.PutObject", send)
    return client
