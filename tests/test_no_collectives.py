"""Save and load issue no collective on the training process group: the protocol talks through the
rendezvous store only, so it is safe beside NCCL and from a background thread.

During the calls every collective raises, at two levels: the Python API (``torch.distributed`` and
``distributed_c10d`` functions, the ``ProcessGroup`` methods, functional collectives, DTensor's
``full_tensor``/``redistribute``) in every thread, and the dispatcher (any ``c10d`` or
``_c10d_functional`` op, which is how FSDP2 and DTensor reach the backend) in the calling thread. A
positive control proves that each level does catch a collective.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import shardsafe

from harness import check_ok, run_ranks
from models import build, full_state, needs_fsdp2_on_cpu, train

COLLECTIVES = [
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce",
    "barrier",
    "monitored_barrier",
    "all_gather_object",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
]
PROCESS_GROUP_METHODS = [
    "allreduce",
    "allreduce_coalesced",
    "broadcast",
    "allgather",
    "_allgather_base",
    "allgather_into_tensor_coalesced",
    "reduce_scatter",
    "_reduce_scatter_base",
    "reduce_scatter_tensor_coalesced",
    "reduce",
    "barrier",
    "monitored_barrier",
    "gather",
    "scatter",
    "alltoall",
    "alltoall_base",
    "send",
    "recv",
    "recv_anysource",
]
FUNCTIONAL = ["all_reduce", "all_gather_tensor", "all_gather_tensor_autograd", "reduce_scatter_tensor", "broadcast"]
DISPATCH_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


_MISSING = object()


class CollectiveCalled(RuntimeError):
    """A collective ran on the process group while shardsafe had the floor."""


def _forbidden(name: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise CollectiveCalled(f"collective {name} called during a shardsafe save/load")

    return refuse


class _NoCollectiveOps(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Refuses every collective op that reaches the dispatcher (from C++ too) in this thread."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace in DISPATCH_NAMESPACES:
            raise CollectiveCalled(f"collective op {func} dispatched during a shardsafe save/load")
        return func(*args, **(kwargs or {}))


@contextmanager
def _no_collectives() -> Iterator[None]:
    """Every collective raises ``CollectiveCalled`` inside; all is restored on exit."""
    patched: list[tuple[Any, str, Any]] = []
    targets: list[tuple[Any, list[str], str]] = [
        (dist, COLLECTIVES, "torch.distributed"),
        (dist.distributed_c10d, COLLECTIVES, "distributed_c10d"),
        (dist.ProcessGroup, PROCESS_GROUP_METHODS, "ProcessGroup"),
        (funcol, FUNCTIONAL, "functional"),
        (DTensor, ["full_tensor", "redistribute"], "DTensor"),
    ]
    for owner, names, label in targets:
        for name in names:
            if hasattr(owner, name):
                # a class's own attribute as stored (getattr would give a bound or unwrapped object that
                # does not behave the same once set back, e.g. pybind methods of ProcessGroup)
                own = vars(owner).get(name, _MISSING)
                patched.append((owner, name, own))
                setattr(owner, name, _forbidden(f"{label}.{name}"))
    try:
        with _NoCollectiveOps():  # type: ignore[no-untyped-call]
            yield
    finally:
        for owner, name, original in reversed(patched):
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def _controls(model: torch.nn.Module) -> dict[str, str]:
    """Each level refuses a real collective (else this test could not fail)."""
    caught = {}
    probes: dict[str, Callable[[], object]] = {
        "api": lambda: dist.all_reduce(torch.ones(2)),
        "process_group": lambda: dist.group.WORLD.allreduce([torch.ones(2)]),  # type: ignore[union-attr]
        "functional": lambda: funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD),  # type: ignore[arg-type]
    }
    dtensors = [p for p in model.parameters() if isinstance(p, DTensor)]
    if dtensors:
        probes["dtensor"] = lambda: dtensors[0].full_tensor()
        local = dtensors[0].to_local()
        probes["dispatcher"] = lambda: torch.ops._c10d_functional.all_gather_into_tensor(local, 2, "0")
    for name, probe in probes.items():
        with _no_collectives():
            try:
                probe()
                caught[name] = "not caught"
            except CollectiveCalled as err:
                caught[name] = str(err)
    return caught


def _save_and_load_without_collectives(rank: int, world: int, path: str, strategy: str) -> dict[str, Any]:
    model, opt = build(strategy)
    train(model, opt, 2)  # collectives of training happen here, before the guard
    state = {"model": model, "optimizer": opt, "step": 2}
    model2, opt2 = build(strategy, seed=7)  # wrapping in DDP verifies shapes with a collective: not ours
    loaded: dict[str, Any] = {"model": model2, "optimizer": opt2, "step": 0}
    controls = _controls(model)
    with _no_collectives():
        shardsafe.save(path, state, timeout=30)
        shardsafe.save(path, state, overwrite=True, timeout=30)
        shardsafe.async_save(f"{path}-async", state, timeout=30).wait()
        shardsafe.load(path, loaded, timeout=30)
    a, b = full_state(model, opt), full_state(model2, opt2)  # outside the guard: full_state gathers
    return {"controls": controls, "bitwise": all(torch.equal(a[k], b[k]) for k in a), "step": loaded["step"]}


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=needs_fsdp2_on_cpu)])
def test_save_and_load_issue_no_collective_on_the_training_group(tmp_path: Any, strategy: str) -> None:
    path = str(tmp_path / "ckpt")
    results = check_ok(run_ranks(_save_and_load_without_collectives, 2, path, strategy, timeout=120))
    for r in results:
        assert all(msg != "not caught" for msg in r["controls"].values()), r["controls"]
        assert strategy != "fsdp" or {"dtensor", "dispatcher"} <= set(r["controls"]), r["controls"]
        assert r["bitwise"] and r["step"] == 2
    shardsafe.verify(path)
    shardsafe.verify(f"{path}-async")
