"""Which entries of a checkpoint that the state did not ask for a load reads and returns
(``shardsafe.load(path, state, rest=...)``, docs/loading.md "What comes back"):

- ``"values"`` (default, as Lightning Fabric's remainder): the small ones. An unrequested entry is
  read when it was not saved from a module or an optimizer and its tensors take at most
  :data:`SMALL_ENTRY_BYTES` together: plain values, step counters, RNG states, a scheduler's state.
  Modules, optimizers and larger entries (a state dict saved as a plain value) stay on disk: not
  size-checked, not read, not decoded, not allocated;
- ``"all"``: every unrequested entry, read whole (tensors on CPU or ``device``);
- ``"none"``: none, as torch.distributed.checkpoint returns nothing beyond the state.

The choice depends on the manifest and the state's keys only, so every rank makes the same one.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, Literal

from shardsafe.display import binary_size
from shardsafe.errors import InvalidArgumentError, MissingKeysError
from shardsafe.format.manifest import Manifest
from shardsafe.state.nodes import refs

Rest = Literal["values", "all", "none"]
RESTS: tuple[Rest, ...] = ("values", "all", "none")

SMALL_ENTRY_BYTES = 1 << 20
"""The most tensor bytes an unrequested entry holds for ``rest="values"`` to read it: an RNG state (5 KiB)
and counters fit, a model's or optimizer's state does not."""


def check_rest(rest: object) -> Rest:
    """``rest`` when it is one of :data:`RESTS`, else ``InvalidArgumentError`` naming them."""
    if not isinstance(rest, str) or rest not in RESTS:
        raise InvalidArgumentError(
            f"rest={rest!r} must be 'values', 'all' or 'none': which entries of the checkpoint that the state does "
            "not ask for come back (the small ones, every one, or none)"
        )
    return rest  # type: ignore[return-value]


def entry_bytes(manifest: Manifest, key: str) -> int:
    """Bytes of every tensor entry ``key`` refers to (every rank's, for values saved per rank)."""
    return sum(manifest.tensors[ref].nbytes for _, ref in refs(manifest.objects[key]["value"]))


def choose(manifest: Manifest, asked: Collection[str], rest: Rest) -> tuple[list[str], dict[str, str]]:
    """(every rank, locally) The unrequested entries to read, in manifest order, and those left on disk
    with what each is (for :class:`Remainder`'s message)."""
    read: list[str] = []
    left: dict[str, str] = {}
    for key, saved in manifest.objects.items():
        if key in asked:
            continue
        size = entry_bytes(manifest, key)
        kind = saved["kind"]
        if rest == "all" or (rest == "values" and kind not in ("module", "optimizer") and size <= SMALL_ENTRY_BYTES):
            read.append(key)
        else:
            what = {"module": "a module", "optimizer": "an optimizer"}.get(kind, f"a {kind} entry")
            left[key] = f"{what}, {binary_size(size)} of tensors"
    return read, left


class Remainder(dict[str, Any]):
    """What a load returns: the unrequested entries it read. Indexing one it left on disk raises
    :class:`MissingKeysError` (a ``KeyError``) saying how to get it; ``in``, ``get`` and iteration see
    only what was read."""

    def __init__(self, entries: Mapping[str, Any], *, path: str, left: Mapping[str, str], rest: str) -> None:
        super().__init__(entries)
        self.path = path
        self.left = dict(left)
        """Entries of the checkpoint left on disk, with what each is."""
        self.rest = rest

    def __missing__(self, key: str) -> Any:
        if key not in self.left:
            raise KeyError(key)
        raise MissingKeysError(
            f"{self.path}: entry {key!r} ({self.left[key]}) was left on disk: the state did not ask for it and "
            f"load(..., rest={self.rest!r}) returns only {_what(self.rest)}. Put it in the state to load it in "
            "place, or pass rest='all' to have every unrequested entry read and returned.",
            missing=[key],
            available=sorted(self),
        )


def _what(rest: str) -> str:
    if rest == "none":
        return "nothing beyond the state"
    return "small entries (no module or optimizer, at most 1 MiB of tensors)"
