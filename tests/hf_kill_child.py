"""A training process for the kill -9 rounds of tests/test_accelerate.py: ``python hf_kill_child.py ROOT``.

It resumes with ``accelerator.load_state()`` when ``ROOT/checkpoints`` holds checkpoints (and prints
``resumed <step>``), then trains and calls ``save_state()`` (automatic naming, ``total_limit=2``) in a loop,
printing ``saved <step>`` after each, until it is killed."""

from __future__ import annotations

import os
import re
import sys

import torch
from accelerate.utils import ProjectConfiguration, set_seed

from shardsafe.accelerate import Accelerator


class Progress:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


def main(root: str) -> None:
    config = ProjectConfiguration(project_dir=root, automatic_checkpoint_naming=True, total_limit=2)
    acc = Accelerator(cpu=True, project_config=config)
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    progress = Progress()
    acc.register_for_checkpointing(progress)
    model, opt = acc.prepare(model, opt)
    folder = os.path.join(root, "checkpoints")
    numbers = (
        [int(m.group(1)) for n in os.listdir(folder) if (m := re.match(r"^checkpoint_(\d+)$", n))]
        if (os.path.isdir(folder))
        else []
    )
    if numbers:
        acc.load_state()
        print(f"resumed {progress.step}", flush=True)
        acc.project_configuration.iteration = max(numbers) + 1
    while True:
        loss = model(torch.randn(16, 256)).square().mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        progress.step += 1
        acc.save_state()
        print(f"saved {progress.step}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
