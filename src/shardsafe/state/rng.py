"""``shardsafe.RNGState``: this process's random generators as one entry of the state, kept per rank.

Saved: Python's ``random`` module, NumPy's global generator (when numpy can be imported), torch's CPU
generator and the generators of every accelerator torch has started (CUDA, XPU: one per device; MPS).
Each rank's own (state/per_rank.py: a ``per_rank`` node), as tensors its rank writes, so the manifest
holds only their names whatever the world size. Loaded on as many ranks as saved, each rank gets its
own generators back and random streams continue bit for bit. On another number of ranks no rank owns a
saved state: ``per_rank="drop"`` (the default) leaves this process's generators as they are and logs a
WARNING naming the entry; ``"error"`` treats it as a missing key (``strict=True`` refuses the load).
"""

from __future__ import annotations

import logging
import random
from typing import Any, Literal

import torch

from shardsafe.errors import CorruptCheckpointError, InvalidArgumentError

logger = logging.getLogger(__name__)

__all__ = ["RNGState"]

Policy = Literal["drop", "error"]

_DEVICE_LISTS = ("cuda", "xpu")
"""Accelerator modules of torch with one generator per device (``get_rng_state_all``)."""


class RNGState:
    """A state entry (``{"rng": shardsafe.RNGState(), ...}``) holding this process's random generators,
    kept per rank; see the module docstring and docs/integrations.md.

    ``per_rank``: what a load on another number of ranks than the save does: ``"drop"`` (the default,
    as frameworks resume on another world size with fresh streams) keeps the current generators and
    warns; ``"error"`` makes the entry missing (``strict=True``: :class:`MissingKeysError` before
    anything changes)."""

    def __init__(self, *, per_rank: Policy = "drop") -> None:
        if per_rank not in ("drop", "error"):
            raise InvalidArgumentError(f"RNGState(per_rank={per_rank!r}): give 'drop' or 'error'")
        self.per_rank: Policy = per_rank

    def __repr__(self) -> str:
        return f"RNGState(per_rank={self.per_rank!r})"

    def state_dict(self) -> dict[str, Any]:
        """The generators' states now: tensors and plain values (``torch.save`` can hold it too)."""
        version, internal, gauss_next = random.getstate()
        python = {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss_next}
        out: dict[str, Any] = {"python": python, "torch": torch.get_rng_state()}
        np = _numpy()
        if np is not None:
            kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
            out["numpy"] = {
                "kind": str(kind),
                "keys": torch.from_numpy(keys.astype(np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            }
        for name in _DEVICE_LISTS:
            module = getattr(torch, name, None)
            started = getattr(module, "is_initialized", None)  # a generator nobody started is left unstarted
            if module is not None and module.is_available() and (started is None or started()):
                out[name] = [s.cpu() for s in module.get_rng_state_all()]
        mps = getattr(torch, "mps", None)
        if mps is not None and torch.backends.mps.is_available():
            out["mps"] = mps.get_rng_state()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Set the generators ``state`` holds; generators it does not hold stay as they are (a
        generator saved where this process has none, or more devices than it has, is logged)."""
        if not isinstance(state, dict) or "python" not in state or "torch" not in state:
            raise CorruptCheckpointError(f"RNGState: not a state of random generators: {_describe(state)}")
        py = state["python"]
        random.setstate((int(py["version"]), tuple(int(x) for x in py["state"].tolist()), py["gauss_next"]))
        torch.set_rng_state(_bytes(state["torch"]))
        if "numpy" in state:
            np = _numpy()
            if np is None:
                logger.warning("shardsafe: RNGState: the checkpoint holds NumPy's generator; numpy is not installed")
            else:
                s = state["numpy"]
                keys = s["keys"].numpy().astype(np.uint32)
                np.random.set_state((s["kind"], keys, s["pos"], s["has_gauss"], s["cached_gaussian"]))
        for name in _DEVICE_LISTS:
            if name in state:
                _set_devices(name, state[name])
        if "mps" in state:
            if torch.backends.mps.is_available():
                torch.mps.set_rng_state(_bytes(state["mps"]))
            else:
                logger.warning("shardsafe: RNGState: the checkpoint holds an MPS generator; this process has no MPS")


def _set_devices(name: str, saved: list[torch.Tensor]) -> None:
    module = getattr(torch, name, None)
    count = module.device_count() if module is not None and module.is_available() else 0
    if count != len(saved):
        logger.warning(
            "shardsafe: RNGState: the checkpoint holds %d %s generator(s), this process has %d device(s): %s set",
            len(saved),
            name,
            count,
            f"the first {min(count, len(saved))}" if count else "none",
        )
    for device in range(min(count, len(saved))):
        module.set_rng_state(_bytes(saved[device]), device)  # type: ignore[union-attr]


def _bytes(t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
        raise CorruptCheckpointError(f"RNGState: a generator's state is a uint8 tensor, not {_describe(t)}")
    return t.cpu().contiguous()


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {list(value)[:6] if isinstance(value, dict) else ''}".strip()


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy
