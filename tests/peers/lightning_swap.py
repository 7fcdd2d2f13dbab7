"""Lightning's own tests with shardsafe's Trainer strategies swapped in for Lightning's (docs/lightning.md,
"Lightning's tests, swapped").

Two uses:

- a pytest plugin: ``pytest -p lightning_swap LIGHTNING/tests/tests_pytorch/checkpointing`` (with this
  folder, shardsafe's ``src`` and ``LIGHTNING/tests`` on ``PYTHONPATH``) makes every name a Lightning test
  reaches a strategy by resolve to ``shardsafe.lightning``'s class: the registry names (``"ddp"``,
  ``"ddp_spawn"``..., ``"fsdp"``, ``"single_device"``), the classes ``lightning.pytorch.strategies``
  exports (``DDPStrategy``, ``FSDPStrategy``, ``ModelParallelStrategy``, ``SingleDeviceStrategy``), and the
  Trainer's own choice for ``strategy="auto"`` (one device: ``SingleDeviceStrategy``; several: ``"ddp"``);
- a runner: ``python tests/peers/lightning_swap.py --lightning LIGHTNING --out FILE PATH...`` runs the given
  Lightning test paths twice, stock and swapped (each with a JUnit report), and writes the counts of each
  and every test that fails only swapped with the first line of its failure, for a person to give the
  cause of each.

Not collected by shardsafe's own suite (its name is no ``test_*.py``); nothing of Lightning is copied here.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def swap() -> list[str]:
    """Make Lightning's strategy names and classes resolve to shardsafe's; returns what was replaced."""
    import lightning.pytorch.strategies as pl_strategies
    import lightning.pytorch.strategies.ddp as pl_ddp
    import lightning.pytorch.strategies.fsdp as pl_fsdp
    import lightning.pytorch.strategies.model_parallel as pl_mp
    import lightning.pytorch.strategies.single_device as pl_single
    import lightning.pytorch.trainer.connectors.accelerator_connector as connector
    from lightning.pytorch.strategies import StrategyRegistry

    import shardsafe.lightning as ours

    pairs = {
        pl_ddp.DDPStrategy: ours.DDPStrategy,
        pl_fsdp.FSDPStrategy: ours.FSDPStrategy,
        pl_mp.ModelParallelStrategy: ours.ModelParallelStrategy,
        pl_single.SingleDeviceStrategy: ours.SingleDeviceStrategy,
    }
    replaced = []
    for name, entry in list(StrategyRegistry.items()):
        if entry["strategy"] in pairs and not name.startswith("shardsafe_"):
            entry["strategy"] = pairs[entry["strategy"]]
            replaced.append(f"registry {name!r}")
    for module in (pl_strategies, connector, sys.modules.get("lightning.pytorch"), pl_ddp, pl_fsdp, pl_mp, pl_single):
        if module is None:
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, type) and value in pairs:
                setattr(module, attr, pairs[value])
                replaced.append(f"{module.__name__}.{attr}")
    return replaced


def pytest_configure(config: Any) -> None:
    """(pytest plugin) Swap before any test module is imported. The processes Lightning's DDP launcher starts
    rerun the same pytest command line, this plugin included, so they swap too."""
    replaced = swap()
    config.stash[_KEY] = replaced


def pytest_report_header(config: Any) -> str:
    return f"shardsafe swap: {len(config.stash[_KEY])} names resolve to shardsafe.lightning"


def _stash_key() -> Any:
    import pytest

    return pytest.StashKey[list[str]]()


_KEY = _stash_key()


# ------------------------------------------------------------------------------------------- runner


def _run(lightning: Path, paths: list[str], swapped: bool, report: Path, timeout: int) -> tuple[int, float]:
    tests = lightning / "tests"
    env = dict(os.environ)
    extra = [str(ROOT / "src"), str(Path(__file__).parent), str(tests)]
    env["PYTHONPATH"] = os.pathsep.join([*extra, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rN", f"--junitxml={report}"]
    cmd += [f"--timeout={timeout}", *(["-p", "lightning_swap"] if swapped else []), *paths]
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=lightning, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return done.returncode, time.monotonic() - start


def _outcomes(report: Path) -> dict[str, tuple[str, str]]:
    """test id -> (outcome, first line of its message) from a JUnit report."""
    out: dict[str, tuple[str, str]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = (
                    (child.get("message") or child.text or "").strip().splitlines()[0][:300]
                    if (child.get("message") or child.text)
                    else ""
                )
                break
        out[name] = (outcome, message)
    return out


def _counts(outcomes: dict[str, tuple[str, str]]) -> dict[str, int]:
    counts = {k: 0 for k in ("passed", "failed", "error", "skipped")}
    for outcome, _ in outcomes.values():
        counts[outcome] += 1
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lightning", type=Path, required=True, help="a checkout of Lightning's source")
    parser.add_argument("--out", type=Path, required=True, help="the Markdown file the counts go to")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per test")
    parser.add_argument("--only", choices=("stock", "swapped"), help="run one side (the other's report reused)")
    parser.add_argument("paths", nargs="+", help="test paths, relative to the Lightning checkout")
    args = parser.parse_args(argv)
    work = args.out.with_suffix("")
    work.mkdir(parents=True, exist_ok=True)
    rows, only_swapped = [], []
    for path in args.paths:
        slug = path.strip("/").replace("/", "_").replace(".py", "")
        reports = {side: work / f"{slug}.{side}.xml" for side in ("stock", "swapped")}
        walls: dict[str, float] = {}
        for side in ("stock", "swapped"):
            if args.only not in (None, side) and reports[side].exists():
                continue
            _, walls[side] = _run(args.lightning, [path], side == "swapped", reports[side], args.timeout)
        stock, swapped = _outcomes(reports["stock"]), _outcomes(reports["swapped"])
        rows.append((path, _counts(stock), _counts(swapped), walls))
        for test, (outcome, message) in sorted(swapped.items()):
            if outcome in ("failed", "error") and stock.get(test, ("",))[0] not in ("failed", "error"):
                only_swapped.append((test, outcome, message))
    lines = ["| path | stock: passed / failed / error / skipped | swapped: passed / failed / error / skipped |"]
    lines.append("| --- | --- | --- |")
    for path, a, b, _ in rows:
        fmt = "{passed} / {failed} / {error} / {skipped}"
        lines.append(f"| `{path}` | {fmt.format(**a)} | {fmt.format(**b)} |")
    lines += ["", f"Failing only swapped ({len(only_swapped)}):", ""]
    lines += [f"- `{t}` ({o}): {m}" for t, o, m in only_swapped]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
