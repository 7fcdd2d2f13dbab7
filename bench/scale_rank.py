"""One simulated rank of bench/scale_sim.py, in a process of its own (a fake process group of the
layout's world size, this rank's coordinate, real DTensors over untouched memory):

    python bench/scale_rank.py load SPEC.json    # load planning: shardsafe's plan_load, DCP's planner
    python bench/scale_rank.py check SPEC.json   # the simulation's inputs against the real ones

``load``: shardsafe's ``engine/load.py:plan_load`` on the committed checkpoint (what a rank does
before the go/no-go: the manifest, the indexes of the data files its shards meet, the reads), and DCP's
load planning (read and unpickle ``.metadata``, ``DefaultLoadPlanner.set_up_planner`` and
``create_local_plan``): the median seconds of three runs after a first (DCP: ``dcp_reps``), the peak
growth of the resident memory of the first (cold), the metadata bytes read.

``check``: shardsafe's real ``flatten`` of the real state against bench/scale_layouts.py's synthetic
one (names, rules, boxes, owners), and DCP's real ``create_local_plan`` against bench/scale_dcp.py's
(every item's index and box); the save planning seconds of both on the real state.

Prints one JSON object."""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "src"))


def rss() -> tuple[int, int]:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def measured(fn: Any, reps: int = 3) -> tuple[float, int, Any, dict[str, float]]:
    """(median wall seconds of ``reps`` runs after the first, peak resident growth of the first (cold:
    lazy imports and caches included), result, and: the median CPU seconds of those runs (what the
    planning costs, whatever else shares the machine), the cold run's seconds, the warm runs' growth)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM back to the current resident size
    before, _ = rss()
    started = time.perf_counter()
    out = fn()
    cold_seconds = time.perf_counter() - started
    cold = rss()[1] - before
    times, cpu, warm = [], [], 0
    for _ in range(reps):
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before, _ = rss()
        started, used = time.perf_counter(), time.process_time()
        fn()
        times.append(time.perf_counter() - started)
        cpu.append(time.process_time() - used)
        warm = max(warm, rss()[1] - before)
    extra = {"cpu_seconds": statistics.median(cpu), "cold_seconds": cold_seconds, "warm_rss_growth": warm}
    return statistics.median(times), cold, out, extra


def setup(spec: dict[str, Any]) -> Any:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from bench.scale_layouts import MODELS, Layout

    layout = Layout(MODELS[spec["model"]], spec["strategy"], spec["world"])
    dist.init_process_group("fake", store=FakeStore(), rank=spec["rank"], world_size=spec["world"])
    return layout


def load(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from bench.scale_dcp import PARAM_GROUP, metadata_of
    from bench.scale_layouts import dtensor_state
    from shardsafe.deadline import Deadlines
    from shardsafe.engine.load import plan_load
    from shardsafe.storage import get_storage

    layout = setup(spec)
    rank, world = spec["rank"], spec["world"]
    model, opt, dcp_state = dtensor_state(layout, rank)
    for k, v in PARAM_GROUP.items():
        dcp_state[f"optim.param_groups.0.{k}"] = v
    dcp_state["optim.param_groups.0.params"] = [n for n, _, _ in layout.model.params()]
    path = spec["path"]
    storage = get_storage(path, None)
    state = {"model": model, "optim": opt}

    def mine() -> Any:
        clock = Deadlines(arrive=600, io=600).start()
        return plan_load(
            path,
            storage,
            state,
            strict=True,
            cast=False,
            device=None,
            allow_pickle=False,
            rank=rank,
            world_size=world,
            clock=clock,
            planning=lambda: None,
            rest="values",
        )

    seconds, growth, plan, extra = measured(mine)
    manifest_bytes = Path(path, "MANIFEST.json").stat().st_size
    index_bytes = sum(plan.manifest.files[f].header_bytes + idx.nbytes for f, idx in plan.source.indexes.items())
    own = {
        "seconds": seconds,
        "rss_growth": growth,
        "manifest_bytes": manifest_bytes,
        "index_files": len(plan.source.indexes),
        "index_bytes": index_bytes,
        "metadata_bytes": manifest_bytes + index_bytes,
        "tasks": len(plan.tasks),
        "bytes_to_read": sum(t.chunk.end - t.chunk.begin for t in plan.tasks),
        **extra,
    }
    del plan
    gc.collect()
    if not spec["dcp_metadata"]:  # not built (too large for this machine): extrapolated by the report
        return {"shardsafe": own, "dcp": None, "local_bytes": layout.local_bytes(rank), "torch": torch.__version__}

    def dcp() -> Any:
        metadata = metadata_of(Path(spec["dcp_metadata"]).read_bytes())
        planner = DefaultLoadPlanner()
        planner.set_up_planner(dcp_state, metadata, is_coordinator=False)
        return planner.create_local_plan()

    seconds, growth, plan, extra = measured(dcp, reps=spec.get("dcp_reps", 3))
    theirs = {
        "seconds": seconds,
        "rss_growth": growth,
        **extra,
        "metadata_bytes": Path(spec["dcp_metadata"]).stat().st_size,
        "items": len(plan.items),
    }
    return {"shardsafe": own, "dcp": theirs, "local_bytes": layout.local_bytes(rank), "torch": torch.__version__}


def check(spec: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from bench.scale_dcp import local_plan
    from bench.scale_layouts import dtensor_state
    from shardsafe.engine.plan import plan_save
    from shardsafe.state.flatten import flatten

    layout = setup(spec)
    rank, world = spec["rank"], spec["world"]
    model, opt, dcp_state = dtensor_state(layout, rank)
    real = flatten({"model": model, "optim": opt})
    sim = layout.flat(rank)

    def described(flat: Any) -> list[Any]:
        return [
            (i.name, i.shape, i.replicated, i.owner, sorted((o, tuple(d.shape)) for o, d in i.boxes()), i.rule)
            for i in flat.items
        ]

    same_flat = described(real) == described(sim) and real.objects == sim.objects
    mine_s, _, plan, _ = measured(lambda: plan_save(real, rank, world))
    same_rules = plan.rules == plan_save(sim, rank, world).rules

    def dcp() -> Any:
        planner = DefaultSavePlanner()
        planner.set_up_planner(dcp_state, storage_meta=None, is_coordinator=rank == 0)
        return planner.create_local_plan()

    dcp_s, _, theirs, _ = measured(dcp)
    ours = local_plan(layout, rank)

    def items(plan: Any) -> list[Any]:
        return sorted(
            (i.index.fqn, tuple(i.index.offset or ()), str(i.type), tuple(i.tensor_data.chunk.sizes))
            for i in plan.items
            if i.tensor_data is not None
        )

    return {
        "flatten_matches": same_flat,
        "rules_match": same_rules,
        "dcp_plan_matches": items(theirs) == items(ours),
        "shardsafe_plan_save_seconds": mine_s,
        "dcp_create_local_plan_seconds": dcp_s,
    }


if __name__ == "__main__":
    mode, spec_path = sys.argv[1], sys.argv[2]
    spec = json.loads(Path(spec_path).read_text())
    print(json.dumps({"load": load, "check": check}[mode](spec)))
