"""Retries of object-store requests: transient errors (throttling, connection resets, timeouts, 5xx)
are retried with exponential backoff and jitter until an overall deadline; anything else, and the
last transient error once the deadline has passed, is raised. The final error names the operation
and the path.

Only idempotent requests go through :func:`call` (a ranged GET, a whole-object PUT, a part upload,
a delete, a listing); the caller makes a non-idempotent step safe to repeat before retrying it (see
the multipart completion in :mod:`shardsafe.storage.remote`).
"""

from __future__ import annotations

import errno
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from shardsafe import knobs
from shardsafe.deadline import Deadline
from shardsafe.errors import CheckpointTimeoutError, InvalidArgumentError, RemoteIOError
from shardsafe.workers import run_bounded

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Errors that mean "this request may succeed if sent again". Matched by class name through the
# exception chain, so neither botocore nor aiohttp is imported here.
_TRANSIENT_CLASS_NAMES = frozenset(
    {
        "ConnectionError",
        "TimeoutError",
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "HTTPClientError",
        "IncompleteRead",
        "ResponseParserError",
        "FSTimeoutError",
        "ClientPayloadError",
        "ClientConnectionError",
        "ServerDisconnectedError",
        "ServerTimeoutError",
    }
)
# S3-style error codes of throttling and server trouble.
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "TooManyRequests",
        "RequestLimitExceeded",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
        "OperationAborted",
        "ConditionalRequestConflict",  # 409: another conditional write of the key was in progress
    }
)
# Answers that say the store will never carry the request out, however often it is sent: a 501 is a
# 5xx, but it means the store does not implement something the request asks for (a header, say).
_NEVER_CODES = frozenset({"NotImplemented"})
_NEVER_STATUS = frozenset({501})
# errno values s3fs and the OS use for the same (s3fs maps 503 SlowDown to EBUSY, 500 to EREMOTEIO).
_TRANSIENT_ERRNOS = frozenset(
    {
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.ECONNREFUSED,
        errno.EPIPE,
        errno.ETIMEDOUT,
        errno.EAGAIN,
        errno.EBUSY,
        getattr(errno, "EREMOTEIO", 121),
    }
)
# Never worth repeating, whatever else is in the chain.
_PERMANENT = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)


def retry_seconds() -> float:
    """Overall seconds one storage request may spend on retries (``SHARDSAFE_REMOTE_RETRY_SECONDS``)."""
    return knobs.remote_retry_seconds()


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How long and how often to retry one request."""

    deadline: float = 120.0
    """Seconds from the first attempt after which a transient failure is final."""
    base_delay: float = field(default_factory=knobs.remote_retry_first_delay)
    """Sleep before the first retry; doubles after each failed attempt."""
    max_delay: float = field(default_factory=knobs.remote_retry_max_delay)
    """Longest sleep between two attempts."""

    def __post_init__(self) -> None:
        for name in ("deadline", "base_delay", "max_delay"):
            value = getattr(self, name)
            if not value > 0:
                raise InvalidArgumentError(f"RetryPolicy.{name}={value!r} must be a positive number of seconds")

    @staticmethod
    def from_env() -> RetryPolicy:
        return RetryPolicy(deadline=retry_seconds())

    def delay(self, attempt: int) -> float:
        """Sleep after failed attempt number ``attempt`` (1-based): exponential, half of it jittered,
        so ranks throttled together do not retry in lockstep."""
        cap = min(self.max_delay, self.base_delay * 2.0 ** (attempt - 1))
        return cap / 2 + random.uniform(0, cap / 2)


def http_answer(err: BaseException) -> tuple[int | None, str]:
    """(HTTP status, error code) of the store's answer that ``err`` (or an error it was raised from)
    carries; ``(None, "")`` when no answer came (a reset, a timeout: the request may have landed)."""
    seen: set[int] = set()
    cur: BaseException | None = err
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        response = getattr(cur, "response", None)  # botocore's ClientError
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return (status if isinstance(status, int) else None), str(response.get("Error", {}).get("Code", ""))
        cur = cur.__cause__ or cur.__context__
    return None, ""


def is_refusal(err: BaseException) -> bool:
    """Whether ``err`` is the store's definite refusal of the request: an answer (4xx, or 501) that
    neither a repeat (as throttling, a timeout or a conflict would) nor a late copy can turn into a
    success. A 412 is a refusal too; callers tell it apart
    (:func:`~shardsafe.storage.uploads.precondition_failed`)."""
    status, code = http_answer(err)
    if status is None or code in _TRANSIENT_CODES:
        return False
    return (400 <= status < 500 and status not in (408, 409, 429)) or status in _NEVER_STATUS or code in _NEVER_CODES


def is_transient(err: BaseException) -> bool:
    """Whether ``err`` (or an error it was raised from) says the request may succeed if repeated."""
    seen: set[int] = set()
    cur: BaseException | None = err
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, _PERMANENT):
            return False
        if _never_one(cur):
            return False
        if _transient_one(cur):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def _never_one(err: BaseException) -> bool:
    response = getattr(err, "response", None)
    if not isinstance(response, dict):
        return False
    code = str(response.get("Error", {}).get("Code", ""))
    return response.get("ResponseMetadata", {}).get("HTTPStatusCode") in _NEVER_STATUS or code in _NEVER_CODES


def _transient_one(err: BaseException) -> bool:
    if isinstance(err, (ConnectionError, TimeoutError)):
        return True
    if any(cls.__name__ in _TRANSIENT_CLASS_NAMES for cls in type(err).__mro__):
        return True
    if isinstance(err, OSError) and err.errno in _TRANSIENT_ERRNOS:
        return True
    response = getattr(err, "response", None)  # botocore's ClientError
    if isinstance(response, dict):
        code = str(response.get("Error", {}).get("Code", ""))
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in _TRANSIENT_CODES or (isinstance(status, int) and (status == 429 or status >= 500)):
            return True
    return False


def call(op: str, path: str, fn: Callable[[], T], policy: RetryPolicy, deadline: Deadline | None = None) -> T:
    """(any thread) Run ``fn`` until it succeeds, a non-transient error occurs, or ``policy.deadline``
    passes. ``op`` and ``path`` name the request in logs and in the final error.

    With ``deadline`` (the operation's) every attempt runs on a daemon thread
    (:func:`shardsafe.workers.run_bounded`) waited for until then, so a request the client's own
    timeouts and retries would hold for minutes (a black-holed endpoint) is cut at the deadline, and no
    retry starts past it."""
    if deadline is not None and not math.isfinite(deadline.at):
        deadline = None  # timeout=inf: the policy alone bounds the retries
    start = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        try:
            if deadline is None:
                return fn()
            if deadline.expired():
                raise CheckpointTimeoutError(
                    f"{op} {path}: the operation's deadline passed before the request was sent"
                )
            return run_bounded(op, path, deadline, fn)
        except Exception as err:
            if not is_transient(err):
                raise
            now = time.monotonic()
            elapsed = now - start
            sleep = policy.delay(attempt)
            if elapsed + sleep > policy.deadline or (deadline is not None and now + sleep >= deadline.at):
                raise RemoteIOError(
                    err.errno if isinstance(err, OSError) and err.errno else errno.EIO,
                    f"{op} {path}: still failing after {attempt} attempts in {elapsed:.1f}s "
                    f"({type(err).__name__}: {err}); the store is unreachable or throttling. "
                    f"Check the endpoint and network, or allow longer with SHARDSAFE_REMOTE_RETRY_SECONDS "
                    f"(now {policy.deadline:g}) or the call's timeout=",
                ) from err
            logger.debug("%s %s: attempt %d failed (%s: %s); retrying in %.2fs", op, path, attempt,
                         type(err).__name__, err, sleep)  # fmt: skip
            time.sleep(sleep)
