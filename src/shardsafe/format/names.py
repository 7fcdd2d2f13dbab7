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
