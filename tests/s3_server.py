"""A real S3 HTTP endpoint on the loopback interface: moto's standalone server in a child process.

Run as a script it binds ``127.0.0.1`` on a port the OS picks (port 0: no bind-close race), prints
``PORT <n>`` on stdout, and serves until its stdin closes, so it never outlives the process that
started it. :class:`S3Server` starts one, waits for the port line with a deadline, and stops it.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import time
import uuid
from types import TracebackType
from typing import Any

START_TIMEOUT = 60.0
STOP_TIMEOUT = 10.0


class S3Server:
    """The moto server in a child process. ``with S3Server() as s3: s3.storage_options`` gives what
    ``s3fs`` needs to reach it; :meth:`new_bucket` makes an empty bucket for one test."""

    def __init__(self, *, min_part_bytes: int = 5 * 1024 * 1024) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0
        self.min_part_bytes = min_part_bytes
        """Smallest multipart part the server accepts (S3's 5 MiB unless told; tests use less)."""

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options for this endpoint."""
        return {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": "us-east-1"},
        }

    def start(self) -> S3Server:
        env = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "S3_UPLOAD_PART_MIN_SIZE": str(self.min_part_bytes),
        }
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                line = self.proc.stdout.readline()
                if line.startswith("PORT "):
                    self.port = int(line.split()[1])
                    return self
                if not line:
                    break
            if self.proc.poll() is not None:
                break
        self.stop()
        raise RuntimeError(f"the moto S3 server did not report its port within {START_TIMEOUT:.0f}s")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()  # the server exits when its stdin closes
        try:
            proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT)
        if proc.stdout is not None:
            proc.stdout.close()

    def new_bucket(self) -> str:
        """Create an empty bucket with a unique name and return that name."""
        import s3fs

        name = f"t-{uuid.uuid4().hex[:12]}"
        s3fs.S3FileSystem(**self.storage_options).call_s3("create_bucket", Bucket=name)
        return name

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _serve() -> None:
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    _, port = server.get_host_and_port()
    print(f"PORT {port}", flush=True)
    try:
        sys.stdin.read()  # returns at EOF: the parent closed our stdin or died
    finally:
        server.stop()


if __name__ == "__main__":
    _serve()
