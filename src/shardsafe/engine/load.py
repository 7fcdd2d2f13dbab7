"""The load protocol (DESIGN.md). (all ranks) rendezvous; read and validate the manifest; work out
this rank's destinations (the local box of every requested tensor, whatever the save world size);
check every requested key and shape BEFORE modifying anything; read only the needed byte ranges,
verified, into the destinations; restore modules, optimizers and stateful objects through their own
load paths; report success or failure to the other ranks through the store.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardsafe.coord import Coordinator, Deadlines, fault_point
from shardsafe.engine.read import Task, check_sizes, plan_reads, read_manifest, run_tasks
from shardsafe.errors import CheckpointError, CoordinationError, MissingKeysError
from shardsafe.format.manifest import Manifest
from shardsafe.format.values import decode, tensor_refs, validate
from shardsafe.state.flatten import kind_of, local_box, optimizer_names, param_names, unwrap
from shardsafe.storage import get_storage

logger = logging.getLogger(__name__)


@dataclass
class _Plan:
    tasks: list[Task] = field(default_factory=list)
    apply: list[Any] = field(default_factory=list)  # callables run after the reads
    missing: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # entries the state did not ask for


def load(
    path: str,
    state: MutableMapping[str, Any] | None,
    *,
    strict: bool,
    deadlines: Deadlines,
    group: Any,
    allow_pickle: bool,
    storage_options: dict[str, Any] | None,
) -> dict[str, Any]:
    """(all ranks of the group, or one process) See :func:`shardsafe.load`."""
    path = str(path)
    storage = get_storage(path, storage_options)
    single = state is None
    coord = None if single else Coordinator.join("load", path, deadlines=deadlines, group=group, heartbeat=True)
    started = time.monotonic()
    phase = "manifest"
    try:
        if coord is not None:
            fault_point("load.rendezvous", coord.global_rank)
        manifest = read_manifest(storage, path)
        phase = "read"
        first = (lambda: fault_point("load.read", coord.global_rank)) if coord else (lambda: None)
        if state is None:
            for key, obj in manifest.objects.items():
                validate(obj["value"], f"{path}: {key}", allow_pickle=allow_pickle)
            check_sizes(storage, path, manifest, list(manifest.tensors))
            resolved: dict[str, torch.Tensor] = {}
            tasks = []
            for name, entry in manifest.tensors.items():
                resolved[name] = torch.empty(entry.shape, dtype=entry.dtype)
                tasks += plan_reads(name, entry, resolved[name], (0,) * len(entry.shape))
            nbytes = run_tasks(storage, path, manifest, tasks, first, deadlines.io)
            out = {k: _decode(manifest, k, resolved, allow_pickle, path) for k in manifest.objects}
        else:
            # tensors that may be allocated from manifest shapes: everything but a module's own parameters
            sized = [
                ref
                for key, obj in manifest.objects.items()
                if obj["kind"] != "module" or key not in state
                for ref in tensor_refs(obj["value"])
            ]
            check_sizes(storage, path, manifest, sized)
            plan = _plan(manifest, state, strict, allow_pickle, path)
            nbytes = run_tasks(storage, path, manifest, plan.tasks, first, deadlines.io)
            phase = "restore"
            for fn in plan.apply:
                fn()
            out = plan.extra
            if plan.missing:
                logger.warning(
                    "shardsafe: loaded %s without %s (not in the checkpoint; strict=False)", path, plan.missing
                )
        if coord is not None:
            phase = "confirm"
            coord.barrier("loaded", timeout=deadlines.io)
            coord.acknowledge(timeout=deadlines.arrive)  # rank 0 returns once every live rank knows
    except BaseException as err:
        if coord is not None and not isinstance(err, CoordinationError):
            coord.fail(phase, err)
        raise
    finally:
        if coord is not None:
            coord.close()
    took = time.monotonic() - started
    if coord is None or coord.rank == 0:
        logger.info(
            "shardsafe: loaded %s (%.1f MiB read on rank 0) in %.2fs (%.0f MiB/s)",
            path,
            nbytes / 2**20,
            took,
            nbytes / 2**20 / max(took, 1e-9),
        )
    return out


def _decode(manifest: Manifest, key: str, resolved: dict[str, torch.Tensor], allow_pickle: bool, path: str) -> Any:
    return decode(manifest.objects[key]["value"], f"{path}: {key}", resolved.__getitem__, allow_pickle=allow_pickle)


def _plan(manifest: Manifest, state: MutableMapping[str, Any], strict: bool, allow_pickle: bool, path: str) -> _Plan:
    """Check every requested key against the checkpoint and build the reads, modifying nothing."""
    plan = _Plan()
    for key, obj in manifest.objects.items():  # every value is checked before anything is modified
        validate(obj["value"], f"{path}: {key}", allow_pickle=allow_pickle)
    names = param_names(state)
    missing: list[str] = []
    for key, obj in state.items():
        if key not in manifest.objects:
            missing.append(key)
            continue
        saved = manifest.objects[key]
        kind = kind_of(obj)
        if kind in ("module", "optimizer", "stateful") and saved["kind"] != kind:
            raise CheckpointError(f"{path}: entry {key!r} was saved as a {saved['kind']}, but a {kind} asks for it")
        if kind == "module":
            missing += _plan_module(plan, manifest, key, obj, path)
        elif kind == "optimizer":
            missing += _plan_optimizer(plan, manifest, key, obj, names, path)
        else:
            _plan_value(plan, manifest, key, obj, state, allow_pickle, path)
    if missing and strict:
        raise MissingKeysError(
            f"{path}: the checkpoint lacks {missing}; it holds {sorted(manifest.objects)}"
            f"{_module_keys_hint(manifest, missing)}. Nothing was loaded. Pass strict=False to load what exists "
            "(e.g. weights only) and leave the rest untouched.",
            missing=missing,
            available=sorted(manifest.objects),
        )
    plan.missing = missing
    for key in manifest.objects:
        if key not in state:
            plan.apply.append(_read_whole(plan, manifest, key, allow_pickle, plan.extra.__setitem__, path))
    return plan


def _module_keys_hint(manifest: Manifest, missing: list[str]) -> str:
    inner = [m for m in missing if "/" in m]
    return f" (a module's missing parameters are listed as <entry>/<name>; {len(inner)} of them)" if inner else ""


def _saved_tensors(manifest: Manifest, key: str) -> dict[str, str]:
    """For a module entry: parameter/buffer name -> manifest tensor name."""
    node = manifest.objects[key]["value"]
    if not (isinstance(node, dict) and node.get("$") == "dict"):
        raise CheckpointError(f"entry {key!r} is not a module state dict")
    return {str(k): v["ref"] for k, v in node["items"] if isinstance(v, dict) and v.get("$") == "tensor"}


def _dest(plan: _Plan, manifest: Manifest, name: str, tensor: torch.Tensor, where: str) -> None:
    entry = manifest.tensors[name]
    local, shape, offsets, _, _ = local_box(tensor)
    if shape != entry.shape:
        raise CheckpointError(
            f"{where}: shape mismatch: the checkpoint holds {list(entry.shape)}, the destination is {list(shape)}. "
            "Build the model with the same configuration as the saved one."
        )
    plan.tasks += plan_reads(name, entry, local, offsets)


def _plan_module(plan: _Plan, manifest: Manifest, key: str, module: nn.Module, path: str) -> list[str]:
    target = unwrap(module)
    sd = target.state_dict()
    saved = _saved_tensors(manifest, key)
    missing = [f"{key}/{n}" for n in sd if n not in saved]
    unexpected = [n for n in saved if n not in sd]
    if unexpected:
        missing += [f"{key}: unexpected {n}" for n in unexpected]
    for n, tensor in sd.items():
        if n in saved:
            _dest(plan, manifest, saved[n], tensor, f"{path}: {key}/{n}")
    present = {n: t for n, t in sd.items() if n in saved}
    plan.apply.append(lambda: target.load_state_dict(present, strict=False))
    return missing


def _plan_optimizer(
    plan: _Plan, manifest: Manifest, key: str, opt: torch.optim.Optimizer, names: dict[int, str], path: str
) -> list[str]:
    saved = decode(manifest.objects[key]["value"], key, lambda ref: ref)  # tensors stay as their names
    group_names = optimizer_names(opt, names)
    flat_params = [p for g in opt.param_groups for p in g["params"]]
    index = {n: i for i, n in enumerate(n for g in group_names for n in g)}
    saved_groups = saved["param_groups"]
    if len(saved_groups) != len(group_names) or any(
        sorted(s["params"]) != sorted(g) for s, g in zip(saved_groups, group_names, strict=False)
    ):
        return [f"{key}: parameter groups differ (saved {[s['params'] for s in saved_groups]}, now {group_names})"]
    current = opt.state_dict()["state"]
    new_state: dict[int, dict[str, Any]] = {}
    unknown = [n for n in saved["state"] if n not in index]
    if unknown:
        return [f"{key}: state for parameters the optimizer does not have: {unknown}"]
    for pname, pstate in saved["state"].items():
        i = index[pname]
        param = flat_params[i]
        now = current.get(i, {})
        entry: dict[str, Any] = {}
        for k, v in pstate.items():
            if isinstance(v, str) and v in manifest.tensors:
                t = manifest.tensors[v]
                dest = now.get(k)
                if not isinstance(dest, torch.Tensor):
                    if t.shape == tuple(param.shape):
                        dest = torch.zeros_like(param.detach(), dtype=t.dtype)
                    else:
                        dest = torch.empty(t.shape, dtype=t.dtype)
                _dest(plan, manifest, v, dest, f"{path}: {key}/state/{pname}/{k}")
                entry[k] = dest
            else:
                entry[k] = v
        new_state[i] = entry
    groups = []
    for s, gnames in zip(saved_groups, group_names, strict=True):
        groups.append({**{k: v for k, v in s.items() if k != "params"}, "params": [index[n] for n in gnames]})

    def apply() -> None:
        opt.load_state_dict({"state": new_state, "param_groups": groups})

    plan.apply.append(apply)
    return []


def _plan_value(
    plan: _Plan,
    manifest: Manifest,
    key: str,
    obj: Any,
    state: MutableMapping[str, Any],
    allow_pickle: bool,
    path: str,
) -> None:
    node = manifest.objects[key]["value"]
    refs = tensor_refs(node)
    if isinstance(obj, torch.Tensor) and isinstance(node, dict) and node.get("$") == "tensor":
        _dest(plan, manifest, refs[0], obj, f"{path}: {key}")
        return

    def put(k: str, value: Any) -> None:
        if kind_of(obj) == "stateful":
            obj.load_state_dict(value)
        else:
            state[k] = value

    plan.apply.append(_read_whole(plan, manifest, key, allow_pickle, put, path))


def _read_whole(
    plan: _Plan, manifest: Manifest, key: str, allow_pickle: bool, put: Callable[[str, Any], None], path: str
) -> Callable[[], None]:
    """Plan reading entry ``key`` whole into new CPU tensors; the returned callable decodes it and
    hands the value to ``put`` once the reads are done."""
    fresh: dict[str, torch.Tensor] = {}
    for ref in tensor_refs(manifest.objects[key]["value"]):
        entry = manifest.tensors[ref]
        fresh[ref] = torch.empty(entry.shape, dtype=entry.dtype)
        plan.tasks += plan_reads(ref, entry, fresh[ref], (0,) * len(entry.shape))
    return lambda: put(key, _decode(manifest, key, fresh, allow_pickle, path))
