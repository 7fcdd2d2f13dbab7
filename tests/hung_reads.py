"""Child scripts in which every read of the local storage can be made to hang for good (a dead NFS
server), run in a fresh process so that a test also sees whether that process then exits.

A script's body patches ``LocalStorage.read_into`` or ``LocalStorage.read_bytes`` with ``hung`` once
its checkpoint is saved, then prints ``NAME CLASS SECONDS ...`` lines for the calls it made."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Mapping

PREAMBLE = """\
import sys, threading, time
import torch, shardsafe
from shardsafe.storage.local import LocalStorage
never = threading.Event()
def hung(self, *args, **kwargs):
    never.wait()  # a read that never returns (a dead NFS server)
"""


def script(body: str) -> str:
    """``body`` (indented as in the test file) after the preamble that defines ``hung``."""
    return PREAMBLE + textwrap.dedent(body)


def run(
    code: str, arg: str, env: Mapping[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], dict[str, list[str]]]:
    """Run ``code`` with ``arg`` (within 120 s); the process and its output lines keyed by their first word."""
    done = subprocess.run(
        [sys.executable, "-c", code, arg], capture_output=True, text=True, timeout=120, env=dict(env) if env else None
    )
    return done, {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines() if line}
