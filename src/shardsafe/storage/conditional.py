"""S3 conditional writes, checked rather than trusted.

shardsafe's manifest PUT on S3 carries ``If-Match`` (an overwrite) or ``If-None-Match: *`` (a new
checkpoint), so that a copy of it the network delivers late can never put back a manifest whose data
is gone (:meth:`~shardsafe.storage.remote.FsspecStorage.publish`). A store that ignores those headers
carries such a late copy out: S3-compatible stores exist that do (or answer ``501 NotImplemented``).
So rank 0 checks, once per process for each store endpoint and bucket, on the in-flight marker its
save writes anyway (:func:`put_marker`): the marker's own PUT goes with ``If-None-Match: *``, then
(the first time only) the same key again with ``If-None-Match: *``, and with ``If-Match`` an ETag it
does not have: both must be refused with 412. A store that carries either out, or answers 501 to
one, is refused for saves, naming it: no save there could keep its promise that a late request never
undoes a commit.

Also here: :func:`definite_refusal`, which tells a publish that the store surely refused (nothing
can land later) from one whose outcome is unknown.
"""

from __future__ import annotations

import errno
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

from shardsafe.deadline import Deadline
from shardsafe.errors import StorageError
from shardsafe.storage import retry
from shardsafe.storage.uploads import precondition_failed, s3_call

_checked: dict[tuple[str, str], str] = {}
"""(endpoint, bucket) -> "" when its conditional writes were found to work, else why not."""
_lock = threading.Lock()
_WRONG_ETAG = '"00000000000000000000000000000000"'


def store_of(fs: Any, bucket: str) -> tuple[str, str]:
    """(endpoint, bucket) of an s3fs filesystem: what a check is remembered under and a message names."""
    endpoint = (getattr(fs, "client_kwargs", None) or {}).get("endpoint_url")
    return str(endpoint or "the default AWS S3 endpoint"), bucket


def checked(fs: Any, bucket: str) -> bool:
    """Whether this process already checked the conditional writes of ``fs``'s endpoint and ``bucket``."""
    with _lock:
        return store_of(fs, bucket) in _checked


def forget() -> None:
    """Forget every check (tests)."""
    with _lock:
        _checked.clear()


def _not_implemented(err: BaseException) -> bool:
    status, code = retry.http_answer(err)
    return status == 501 or code == "NotImplemented"


def _refuse(store: tuple[str, str], url: str, why: str) -> StorageError:
    endpoint, bucket = store
    return StorageError(
        errno.ENOTSUP,
        f"the S3 store at {endpoint} (bucket {bucket!r}) {why}: it does not honour conditional writes "
        "(If-Match / If-None-Match), on which shardsafe's commit there relies (a manifest request the network "
        f"delivers late must never replace a newer manifest or one whose data is gone). Nothing was saved to {url}. "
        "Use a store that supports conditional writes (AWS S3 does; so do recent MinIO and Ceph releases: upgrade "
        "it), or save to a local or network filesystem path",
    )


def put_marker(fs: Any, bucket: str, key: str, url: str, policy: retry.RetryPolicy, deadline: Deadline | None) -> None:
    """(rank 0, before any data file of the save) Write the empty in-flight marker ``bucket/key``
    (``url`` in messages) with ``If-None-Match: *``; the first time for this store in this process,
    check its conditional writes on it (module docstring). Raises :class:`StorageError` (``ENOTSUP``)
    naming the store when they do not work; the marker is then removed again."""
    store = store_of(fs, bucket)
    with _lock:
        known = _checked.get(store)
    if known:
        raise _refuse(store, url, known)

    def put(**condition: str) -> Callable[[], Any]:
        return functools.partial(s3_call, fs, "put_object", Bucket=bucket, Key=key, Body=b"", **condition)

    try:
        retry.call("write the in-flight marker", url, put(IfNoneMatch="*"), policy, deadline)
    except OSError as err:
        if _not_implemented(err):
            _remember(store, "answers 501 NotImplemented to a PUT with If-None-Match")
            raise _refuse(store, url, "answers 501 NotImplemented to a PUT with If-None-Match") from err
        if not precondition_failed(err):  # 412: an earlier attempt of this very PUT landed, its reply lost
            raise
    if known is not None:
        return
    problems: list[str] = []
    for what, condition in (("If-None-Match: *", {"IfNoneMatch": "*"}), ("If-Match", {"IfMatch": _WRONG_ETAG})):
        try:
            retry.call("check the store's conditional writes", url, put(**condition), policy, deadline)
        except OSError as err:
            if precondition_failed(err):
                continue
            if _not_implemented(err):
                problems.append(f"answers 501 NotImplemented to a PUT with {what}")
                continue
            raise
        problems.append(f"carried out a PUT whose {what} condition was false (it should have answered 412)")
    why = "; it also ".join(problems)
    _remember(store, why)
    if why:
        _remove(fs, bucket, key, url, policy, deadline)
        raise _refuse(store, url, why)


def _remember(store: tuple[str, str], why: str) -> None:
    with _lock:
        _checked[store] = why


def _remove(fs: Any, bucket: str, key: str, url: str, policy: retry.RetryPolicy, deadline: Deadline | None) -> None:
    """Remove the marker this check just wrote (its own object, like a writer's abort)."""
    delete = functools.partial(s3_call, fs, "delete_object", Bucket=bucket, Key=key)
    try:
        retry.call("remove the in-flight marker", url, delete, policy, deadline)
    except OSError:
        pass  # an empty marker: the sweep of leftovers removes it once old


def definite_refusal(attempts: Sequence[BaseException | None], final: BaseException) -> bool:
    """Whether a request whose attempts ended as ``attempts`` (``None``: an attempt whose end nobody
    saw, abandoned at a deadline) and that raised ``final`` surely never took effect, and never will:
    every attempt was answered with a refusal (:func:`~shardsafe.storage.retry.is_refusal`). A reset, a
    timeout or a 5xx leaves the outcome unknown (the request may still land)."""
    return retry.is_refusal(final) and bool(attempts) and all(a is not None and retry.is_refusal(a) for a in attempts)
