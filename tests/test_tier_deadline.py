"""The local tier's steps have one deadline, the public call's (CheckpointManager's ``timeout=``): a read
of this node's copy that never returns (a dead disk) ends a resume within that deadline, and the process
then exits. Before, the check of the node's copies (every byte read) had no deadline and the resume hung
for ever."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

HUNG = textwrap.dedent(
    """
    import sys, threading, time
    import torch, shardsafe
    from shardsafe.storage.local import LocalStorage
    root, local = sys.argv[1], sys.argv[2]
    tier = shardsafe.LocalTier(local, every_n_steps=1, replicas=0, keep=2)
    with shardsafe.CheckpointManager(root, every_n_steps=10**9, local=tier, timeout=60) as mgr:
        mgr.save_local(1, {"w": torch.arange(8.0)})
    never = threading.Event()
    def hung(self, *args, **kwargs):
        never.wait()  # a read that never returns
    LocalStorage.read_into = hung
    t = time.monotonic()
    with shardsafe.CheckpointManager(root, every_n_steps=10**9, local=tier, timeout=4) as mgr:
        try:
            print("RESUMED", mgr.resume({"w": torch.zeros(8)}), round(time.monotonic() - t, 1), flush=True)
        except shardsafe.CheckpointError as err:
            print("RAISED", type(err).__name__, round(time.monotonic() - t, 1), flush=True)
    """
)


def test_a_hung_read_of_the_nodes_copy_ends_the_resume_within_the_managers_deadline(tmp_path: Path) -> None:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", HUNG, str(tmp_path / "durable"), str(tmp_path / "local-{node}")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - started
    words = done.stdout.split()
    assert words[:1] in (["RESUMED"], ["RAISED"]), (done.stdout, done.stderr[-3000:])
    assert float(words[2]) < 4 + 10, words  # the manager's timeout=4, and the call's own ending
    assert done.returncode == 0, done.stderr[-2000:]
    assert took < 90, f"the process took {took:.0f}s to end after the resume returned: a reader thread held it"
