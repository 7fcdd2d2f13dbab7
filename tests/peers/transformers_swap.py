"""transformers' Trainer resume and rotation tests, stock and with ``transformers.Trainer`` resolving to
:class:`shardsafe.transformers.Trainer` (the plugin ``tests/peers/swap_transformers.py``): counts per run, and
every test that fails only with the swap, with its error. Not part of the default suite.

    python tests/peers/transformers_swap.py --peer /path/to/transformers-tests

``--peer`` is a folder holding ``trainer_test_utils.py`` and ``test_trainer_checkpointing_subset.py``: the
tests ``test_can_resume_training``, ``test_resume_training_with_randomness``, ``test_checkpoint_sorting``,
``test_checkpoint_rotation``, ``test_resume_from_interrupted_training`` and ``test_resume_batch_order`` of
transformers' ``tests/trainer/test_trainer_checkpointing.py`` (a version matching the installed transformers),
with ``trainer_test_utils`` imported by its absolute name. Exit status 0 when it ran."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from accelerate_swap import report, run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer", type=Path, required=True, help="the folder of the copied test files")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()
    selection: list[tuple[str, str | None]] = [("test_trainer_checkpointing_subset.py", None)]
    common = {"selection": selection, "plugin": "swap_transformers", "path_add": (str(args.peer),)}
    report(run(args.peer, False, args.timeout, **common), run(args.peer, True, args.timeout, **common))  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
