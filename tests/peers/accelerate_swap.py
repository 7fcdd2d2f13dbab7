"""Accelerate's own checkpoint tests, stock and with ``accelerate.Accelerator`` resolving to
:class:`shardsafe.accelerate.Accelerator` (the plugin ``tests/peers/swap_accelerate.py``): counts per run,
and every test that fails only with the swap, with its error. Not part of the default suite (its files
need Accelerate's source tree and test dependencies).

    python tests/peers/accelerate_swap.py --peer /path/to/accelerate   # a checkout at the tag of the
                                                                       # installed accelerate (v1.14.0)

Runs ``tests/test_state_checkpointing.py`` whole and the save/load-state tests of
``tests/test_accelerator.py`` (``-k``: ``save_load_model``, which includes the save/load hook tests, and
``save_model_with_stateful_dataloader``). Exit status 0 when it ran (the report says what failed)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
SELECTION = [
    ("tests/test_state_checkpointing.py", None),
    ("tests/test_accelerator.py", "save_load_model or save_model_with_stateful_dataloader"),
]


def run(
    peer: Path,
    swapped: bool,
    timeout: float,
    selection: list[tuple[str, str | None]] = SELECTION,
    plugin: str = "swap_accelerate",
    path_add: tuple[str, ...] = (),
) -> dict[str, tuple[str, str]]:
    """{test id: (outcome, message)} of one pytest run per file of ``selection`` (path under ``peer``, ``-k``
    expression), stock or with ``plugin`` (``-p``) swapping the class; ``path_add`` goes on ``PYTHONPATH``."""
    out: dict[str, tuple[str, str]] = {}
    for path, keyword in selection:
        with tempfile.TemporaryDirectory() as tmp:
            xml = os.path.join(tmp, "report.xml")
            cmd = [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                str(peer / path),
                f"--junitxml={xml}",
            ]
            cmd += ["-o", "addopts="]
            if keyword:
                cmd += ["-k", keyword]
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join([*path_add, env.get("PYTHONPATH", "")])
            if swapped:
                cmd += ["-p", plugin]
                env["PYTHONPATH"] = os.pathsep.join([str(HERE), env["PYTHONPATH"]])
            subprocess.run(cmd, cwd=tmp, env=env, timeout=timeout, capture_output=True, check=False)
            for case in ET.parse(xml).getroot().iter("testcase"):
                name = f"{path}::{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
                outcome, message = "passed", ""
                for child in case:
                    if child.tag in ("failure", "error", "skipped"):
                        outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                        message = (
                            (child.get("message") or "").strip().splitlines()[0][:300] if child.get("message") else ""
                        )
                out[name] = (outcome, message)
    return out


def report(stock: dict[str, tuple[str, str]], swapped: dict[str, tuple[str, str]]) -> None:
    """Print the counts of both runs and every test that fails only with the swap, with its message."""
    for label, result in (("stock", stock), ("swapped", swapped)):
        counts: dict[str, int] = {}
        for outcome, _ in result.values():
            counts[outcome] = counts.get(outcome, 0) + 1
        print(f"{label}: {len(result)} tests: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    only = sorted(
        t for t, (o, _) in swapped.items() if o in ("failed", "error") and stock.get(t, ("", ""))[0] == "passed"
    )
    print(f"failing only with the swap: {len(only)}")
    for t in only:
        print(f"  {t}: {swapped[t][1]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer", type=Path, required=True, help="Accelerate's source tree (its tests/ folder)")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()
    report(run(args.peer, False, args.timeout), run(args.peer, True, args.timeout))
    return 0


if __name__ == "__main__":
    sys.exit(main())
