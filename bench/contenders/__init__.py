"""The contenders: each saves and loads the same :class:`~bench.state.BenchState` its own way.

A contender's :meth:`Contender.rep` runs one repetition of its operations through the session's
:class:`~bench.measure.Ctx` (every rank calls it), deletes what it wrote, and leaves the state as it found
it. Contenders that can load a checkpoint into another world size also implement the reshard pair.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from bench.measure import Ctx
from bench.state import BenchState

RESHARDING = ("dcp", "shardsafe", "baseline")
"""The contenders that load a checkpoint into another world size (they implement the reshard pair)."""


class Contender(ABC):
    """Base of every contender; ``name`` keys its rows in the results."""

    name = ""

    def __init__(self, state: BenchState) -> None:
        self.state = state

    @abstractmethod
    def rep(self, ctx: Ctx) -> None:
        """(every rank) One repetition of this contender's operations, measured through ``ctx``."""

    def save_source(self, path: str) -> None:
        """(every rank) Save the state, untimed, for the reshard sessions to load."""
        raise NotImplementedError(f"{self.name} does not take part in the resharded loads")

    def load_resharded(self, path: str) -> None:
        """(every rank of the new world) Load a checkpoint saved by another world size into the state."""
        raise NotImplementedError(f"{self.name} does not take part in the resharded loads")


def create(name: str, state: BenchState) -> Contender:
    """The contender called ``name`` over ``state``; imports its library only now."""
    if name == "floor":
        from bench.contenders.floors import Floors

        return Floors(state)
    if name == "torch":
        from bench.contenders.torch_save import TorchSave

        return TorchSave(state)
    if name == "dcp":
        from bench.contenders.dcp import Dcp

        return Dcp(state)
    if name == "fabric":
        from bench.contenders.fabric import LightningFabric

        return LightningFabric(state)
    if name == "shardsafe":
        from bench.contenders.shardsafe import Shardsafe

        return Shardsafe(state)
    if name == "baseline":
        from bench.contenders.shardsafe import ShardsafeBaseline

        return ShardsafeBaseline(state)
    raise ValueError(f"unknown contender {name!r}; choose from floor, torch, dcp, fabric, shardsafe, baseline")
