"""A script for ``torchrun``: the end of a job that saves and exits, many times at the cost of one launch.

Each rank imports torch and shardsafe once, then forks its trials one after another: trial ``k`` of
every rank joins a process group of its own (through the launcher's store, under a prefix of its own),
saves a small state with shardsafe, and ends as a script does: its interpreter finalizes (atexit hooks,
then daemon threads are killed where they stand). A shardsafe thread still inside a store request then
aborts the process ("terminate called without an active exception", SIGABRT) after a save that
succeeded. Each rank writes its trials' exit statuses to ``<root>/statuses-<rank>.json``.

    torchrun --standalone --nproc-per-node 2 tests/exit_trials.py ROOT TRIALS
"""

from __future__ import annotations

import gc
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import shardsafe
import shardsafe.engine.api  # imported here once, not by every trial

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
root, trials = sys.argv[1], int(sys.argv[2])
statuses: list[int] = []
trial = None
gc.freeze()  # a forked trial's exit does not write to every page it shares with this process
for k in range(trials):
    pid = os.fork()
    if pid == 0:
        trial = k
        break
    _, status = os.waitpid(pid, 0)
    statuses.append(os.waitstatus_to_exitcode(status))

if trial is None:
    with open(os.path.join(root, f"statuses-{rank}.json"), "w") as f:
        json.dump(statuses, f)
else:
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"trial-{trial}", store), rank=rank, world_size=world)
    torch.manual_seed(trial)  # the same model on both ranks (no DDP wrapper here): replicas must agree
    state = {"model": torch.nn.Linear(16, 8), "step": trial}
    shardsafe.save(os.path.join(root, f"ckpt-{trial}"), state, timeout=60)
    # the script ends here, right after the save, as a training script's last line
