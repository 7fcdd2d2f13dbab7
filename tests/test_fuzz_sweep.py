"""Seeded fuzzing of the sweep of leftovers, the save's target check and the delete rule (the cases
and their invariants: tests/fuzz_sweep.py): saves, overwrites, saves in flight on hosts whose clocks
are up to 2 h apart, saves that took too long, saves through links and with ``base=`` a link,
imports, a manager's cleanup, deletes and ``shardsafe ls`` over roots littered with foreign names,
non-ASCII digits, links, FIFOs, sockets, folders, orphans, markers, pending directories and clock
probes. Every case must keep what is not shardsafe's and what a save in flight still writes, remove
what is abandoned, refuse what it must untouched, write nothing outside the root, and leave a
checkpoint that verifies and loads as the last save that returned.

``SHARDSAFE_FUZZ_SWEEP_CASES`` (default 30 here) and ``SHARDSAFE_FUZZ_SWEEP_SEED`` (default 5) choose
the run; ``python tests/fuzz_sweep.py --cases 2000`` runs a big one outside pytest.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fuzz_sweep import campaign

CASES = int(os.environ.get("SHARDSAFE_FUZZ_SWEEP_CASES", "30"))
SEED = int(os.environ.get("SHARDSAFE_FUZZ_SWEEP_SEED", "5"))


@pytest.mark.timeout(120 + 2 * CASES)
def test_sweep_fuzz_keeps_what_is_not_shardsafes_and_what_is_in_flight(tmp_path: Path) -> None:
    figures = campaign(CASES, SEED, tmp_path)
    print(
        f"\nsweep fuzz: {CASES} cases (seed {SEED}) in {figures['seconds']}s; {figures['violations']} violations; "
        f"modes {figures['modes']}; backends {figures['backends']}; {figures['skewed']} with skewed clocks; "
        f"litter {figures['litter']}"
    )
    assert len(figures["modes"]) >= 5, figures["modes"]  # the run reaches most modes
    assert not figures["problems"], f"{figures['violations']} violations:\n" + "\n".join(figures["problems"][:40])
