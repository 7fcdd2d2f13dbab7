"""The names the format itself specifies (docs/format.md): the save id grammar and the name of the
data file a rank writes in a save. This is their one home: the manifest parser validates with them,
the writer names its files with them, and the catalog (:mod:`shardsafe.catalog.names`) recognises
shardsafe's own files with them, so a name one accepts the others accept too."""

from __future__ import annotations

import re

SAVE_ID_CHARS = r"[A-Za-z0-9._-]{1,128}"
"""A save id: 1 to 128 of ``A-Z a-z 0-9 . _ -``."""
SAVE_ID = re.compile(rf"^{SAVE_ID_CHARS}\Z", re.ASCII)
DATA_FILE = re.compile(rf"^data-(?P<rank>[0-9]{{5}})-(?P<sid>{SAVE_ID_CHARS})\.safetensors\Z", re.ASCII)
"""``data-<rank:05d>-<saveid>.safetensors``; ``rank`` and ``sid`` are its groups. ASCII digits only: a
name with other Unicode digits (Arabic-Indic zeros, say) is no data file, so never shardsafe's to delete."""


def data_file(rank: int, save_id: str) -> str:
    """The data file that ``rank`` writes in save ``save_id``."""
    return f"data-{rank:05d}-{save_id}.safetensors"


def is_data_file_of(name: str, save_id: str) -> bool:
    """Whether ``name`` is a data file of save ``save_id`` (of any rank)."""
    m = DATA_FILE.match(name)
    return m is not None and m["sid"] == save_id


SIDE_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")
"""A side file's name (format v3): one plain name, as a data file's (docs/format.md, section 3b)."""
_RESERVED_SIDE = re.compile(r"(?i)(manifest\.json.*|data-.*\.safetensors)")
"""Names a side file may not take, in any case: the manifest's own (and its temporary), and the data files'."""


def side_file_problem(name: object) -> str | None:
    """Why ``name`` cannot be a side file's name (docs/format.md, section 3b), or ``None`` if it can: a
    plain name inside the checkpoint (``[A-Za-z0-9_][A-Za-z0-9._-]{0,254}`` in full, no ``..``: no ``/``, no
    hidden name) that is not the format's own (``MANIFEST.json`` and its temporary names, data file names),
    compared without case (a case-insensitive filesystem would make them one file)."""
    if not isinstance(name, str):
        return f"a side file's name is a str, not {type(name).__name__}"
    if not SIDE_FILE.fullmatch(name) or ".." in name:
        return (
            f"side file name {name[:80]!r} is not a plain name inside the checkpoint: 1 to 255 of A-Z a-z 0-9 . _ -, "
            "not starting with '.' or '-', no '..' (no '/', no folder)"
        )
    if _RESERVED_SIDE.fullmatch(name):
        return f"side file name {name!r} is taken by the format (MANIFEST.json, data-*.safetensors); choose another"
    return None
