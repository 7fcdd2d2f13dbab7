"""Fixtures for the object-storage tests: one moto S3 server per test session (started on first use,
stopped at the end), a fresh bucket per test, and :class:`FlakyS3FileSystem`, the fault-injecting
wrapper. Test modules import them explicitly: ``from conftest_s3 import s3_bucket, s3_server``."""

from __future__ import annotations

import asyncio
import collections
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

from s3_server import S3Server

pytest.importorskip("moto.server", reason="moto[server] is needed for the S3 tests (requirements-dev.txt)")
s3fs = pytest.importorskip("s3fs", reason="s3fs is needed for the S3 tests (requirements-dev.txt)")
from botocore.exceptions import ClientError  # noqa: E402  (s3fs brings botocore)
from s3fs.errors import translate_boto_error  # noqa: E402

PART = 256 * 1024
"""Multipart part size the tests use (the server is told to accept parts this small)."""
FAULTS_ENV = "SHARDSAFE_TEST_S3_FAULTS"
"""JSON plan for :class:`FlakyS3FileSystem` instances made in spawned ranks."""


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    with S3Server(min_part_bytes=PART) as server:
        yield server


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    return s3_server.new_bucket()


class FlakyS3FileSystem(s3fs.S3FileSystem):  # type: ignore[misc]
    """``s3fs`` whose S3 requests fail on a plan, under the protocol ``flakys3://``. Every request of
    ``s3fs`` (and of shardsafe's multipart writer) passes through ``_call_s3``, so faults hit real
    HTTP requests to the server, above ``s3fs``' own retries.

    ``plan`` maps an S3 method (``upload_part``, ``get_object``...) to actions taken by its next calls
    in order (later calls pass):

    - ``reset``: the connection resets before the request is sent;
    - ``slowdown``: the server answers 503 SlowDown (throttling);
    - ``lost``: the request is carried out, then the reply is lost (a reset);
    - ``down``: this and every later call resets (an outage);
    - ``denied``: 403 AccessDenied (not transient);
    - ``gone``: 404 NoSuchUpload, as S3 may answer a repeated multipart completion.

    ``calls`` counts requests per method; ``max_active`` is the most ``upload_part`` requests in
    flight at once (each held ``part_delay`` seconds, so overlap shows). Without ``plan`` the plan
    comes from ``$SHARDSAFE_TEST_S3_FAULTS`` (JSON), for filesystems made in spawned ranks.
    """

    protocol = ("flakys3",)

    def __init__(self, *args: Any, plan: dict[str, list[str]] | None = None, part_delay: float = 0.0, **kw: Any):
        super().__init__(*args, **kw)
        if plan is None:
            plan = json.loads(os.environ.get(FAULTS_ENV, "{}"))
        self.plan = {method: list(actions) for method, actions in plan.items()}
        self.part_delay = part_delay
        self.calls: collections.Counter[str] = collections.Counter()
        self.injected: collections.Counter[str] = collections.Counter()
        self.active = 0
        self.max_active = 0

    def _next_action(self, method: str) -> str | None:
        actions = self.plan.get(method)
        if not actions:
            return None
        return actions[0] if actions[0] == "down" else actions.pop(0)

    async def _call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self.calls[method] += 1
        action = self._next_action(method)
        if action is not None:
            self.injected[f"{method}:{action}"] += 1
        if action in ("reset", "down"):
            raise ConnectionResetError(f"injected: connection reset during {method}")
        if action == "slowdown":
            raise translate_boto_error(_client_error("SlowDown", 503, "Please reduce your request rate.", method))
        if action == "denied":
            raise translate_boto_error(_client_error("AccessDenied", 403, "Access Denied", method))
        if action == "gone":
            raise translate_boto_error(_client_error("NoSuchUpload", 404, "The upload does not exist", method))
        if method == "upload_part":
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            if method == "upload_part" and self.part_delay:
                await asyncio.sleep(self.part_delay)
            out = await super()._call_s3(method, *args, **kwargs)
        finally:
            if method == "upload_part":
                self.active -= 1
        if action == "lost":
            raise ConnectionResetError(f"injected: reply to {method} lost")
        return out

    def pending(self) -> dict[str, list[str]]:
        """Planned faults not yet injected (``down`` stays)."""
        return {m: a for m, a in self.plan.items() if a and a != ["down"]}


def _client_error(code: str, status: int, message: str, method: str) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": status}}, method
    )
