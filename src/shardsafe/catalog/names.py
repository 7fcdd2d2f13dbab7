"""The names shardsafe writes, and the rule for where a save may go: the one grammar of names the
save's target check, the sweep of leftovers (:mod:`shardsafe.catalog.orphans`), the delete gate
(:mod:`shardsafe.catalog.unlink`) and the listing (``shardsafe ls``, the manager) all use.

shardsafe deletes only what it wrote (:mod:`shardsafe.catalog.delete`), and it knows what it wrote
by name: data files ``data-<rank:05d>-<saveid>.safetensors``, hidden pending directories
``.<name>.staging-<saveid>`` beside a target, the staged manifest inside one, the temporary manifest
``.MANIFEST.json.tmp-<saveid>`` (where the manifest is written then renamed, and, empty, the in-flight
marker of a save whose data files go straight into its target: URL storage), the tombstone
``.MANIFEST.json.deleting`` of a checkpoint being deleted, and the clock probe
``.shardsafe-clock-<id>`` a sweep writes for an instant to read the storage's own time. Beside those,
what a publication of another kind writes (:mod:`shardsafe.catalog.publish`): an export's hidden
folder ``.<name>.export-<id>`` and the folder a replaced export is set aside as ``.<name>.replaced-<id>``,
its marker ``.shardsafe-export.json`` (which lists the export's files), a file export's hidden
``.<name>.export-<id>.tmp``, and the temporary folders shardsafe makes for side files
(``shardsafe-side-files-<id>``: ``shardsafe.side_files_folder``). In a node folder of the local tier
(docs/tiers.md): its step folders ``step-<N>-<save id>`` and, in one, the entries ``rank-<R>`` (a share),
``replica-of-rank-<R>`` (a copy of another rank's), a transfer's hidden folder
``.incoming-<entry>-<pid>-<8 hex>`` and a share's pending directory. The save id grammar and the data
file name are the format's (:mod:`shardsafe.format.names`), used here as they are; every pattern
matches ASCII only.

A save target must be absent, an empty folder, or hold nothing but such names, each a regular file
(a committed checkpoint, or what a crashed save or delete of one left); anything else is refused
untouched, and so is a target that is itself a symbolic link (shardsafe never saves, nor deletes,
through a link).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

from shardsafe.errors import CorruptCheckpointError
from shardsafe.format.manifest import parse_manifest
from shardsafe.format.names import DATA_FILE, SAVE_ID_CHARS, data_file
from shardsafe.storage import is_remote
from shardsafe.storage.base import MANIFEST_NAME, Commit, Storage

__all__ = [
    "CLOCK_PROBE",
    "DATA_FILE",
    "EXPORT_HIDDEN",
    "EXPORT_MARKER",
    "EXPORT_REPLACED",
    "EXPORT_TEMP",
    "LITTER_DIR",
    "PENDING_DIR",
    "SCRATCH_DIR",
    "STAGED_MANIFEST",
    "TEMP_MANIFEST",
    "TIER_INCOMING",
    "TIER_PENDING",
    "TIER_REPLICA",
    "TIER_SHARE",
    "TIER_STEP",
    "TOMBSTONE",
    "basename",
    "clock_probe",
    "commit_of",
    "data_file",
    "export_hidden",
    "export_replaced",
    "export_temp",
    "in_flight_marker",
    "is_export_folder",
    "is_own",
    "is_tier_entry",
    "link_target",
    "listed_side_files",
    "pending_name",
    "plain_name",
    "refusal",
    "save_id_of",
    "temp_manifest",
    "tier_incoming",
    "transfer_file",
]

PENDING_DIR = re.compile(rf"^\.(?P<target>.+)\.staging-(?P<sid>{SAVE_ID_CHARS})\Z", re.ASCII)
LITTER_DIR = re.compile(rf"^\.(?P<target>.+)\.litter-(?P<sid>{SAVE_ID_CHARS})\Z", re.ASCII)
"""What older versions set aside (``.<name>.litter-<id>``): listed, never touched (never checked)."""
TEMP_MANIFEST = re.compile(rf"^\.MANIFEST\.json\.tmp-(?P<sid>{SAVE_ID_CHARS})\Z", re.ASCII)
CLOCK_PROBE = re.compile(rf"^\.shardsafe-clock-(?P<sid>{SAVE_ID_CHARS})\Z", re.ASCII)
"""The empty file a sweep writes, reads the modification time of, and removes: the storage's own
"now" (:class:`shardsafe.catalog.orphans.StorageClock`)."""
TOMBSTONE = ".MANIFEST.json.deleting"
_ID = r"[0-9a-f]{12}"
EXPORT_HIDDEN = re.compile(rf"^\.(?P<target>.+)\.export-(?P<id>{_ID})\Z", re.ASCII)
"""An export's folder while it is written (beside its target), renamed to the target when published."""
EXPORT_REPLACED = re.compile(rf"^\.(?P<target>.+)\.replaced-(?P<id>{_ID})\Z", re.ASCII)
"""A previous export set aside by the one that replaced it, until its listed files are removed."""
EXPORT_TEMP = re.compile(rf"^\.(?P<target>.+)\.export-(?P<id>{_ID})\.tmp\Z", re.ASCII)
"""A file export while it is written (beside its target), linked to the target's name when published."""
EXPORT_MARKER = ".shardsafe-export.json"
"""Lists the files of an export folder, so a later export can recognise (and replace) it and nothing else."""
SCRATCH_DIR = re.compile(r"^shardsafe-side-files-[A-Za-z0-9_]{1,64}\Z", re.ASCII)
"""A temporary folder shardsafe makes (``tempfile.mkdtemp``) for the side files a callback writes."""
TIER_STEP = re.compile(r"^step-(\d{8,})-([0-9]{10}[0-9a-f]{10})\Z", re.ASCII)
"""A step folder of the local tier: one save (its id: 10 digits of time, 10 hex digits) of step N."""
TIER_SHARE = re.compile(r"^rank-(\d{5,})\Z", re.ASCII)
"""A rank's share of a local save (a one-process checkpoint folder) in a step folder."""
TIER_REPLICA = re.compile(r"^replica-of-rank-(\d{5,})\Z", re.ASCII)
"""A copy of another rank's share, received from it, in a step folder."""
TIER_INCOMING = re.compile(r"^\.incoming-(?:rank|replica-of-rank)-(\d{5,})-\d+-[0-9a-f]{8}\Z", re.ASCII)
"""A transfer's hidden folder in a step folder (a copy being received; renamed to its entry when verified)."""
TIER_PENDING = re.compile(rf"^\.(?:rank|replica-of-rank)-(\d{{5,}})\.staging-{SAVE_ID_CHARS}\Z", re.ASCII)
"""The pending directory of a share being saved, in a step folder."""
STAGED_MANIFEST = (MANIFEST_NAME, f"{MANIFEST_NAME}.tmp")
"""The manifest and its temporary file inside a pending directory (uncommitted there)."""


def pending_name(target: str, save_id: str) -> str:
    """The name of the pending directory of save ``save_id`` into the checkpoint named ``target``
    (beside it, on local disks)."""
    return f".{target}.staging-{save_id}"


def temp_manifest(save_id: str) -> str:
    """The temporary manifest of save ``save_id`` where the manifest is written then renamed."""
    return f".{MANIFEST_NAME}.tmp-{save_id}"


def export_hidden(target: str, unique: str) -> str:
    """The hidden folder of an export to the folder named ``target`` (``unique``: 12 hex digits)."""
    return f".{target}.export-{unique}"


def export_replaced(target: str, unique: str) -> str:
    """The name a replaced export of ``target`` is set aside under until its files are removed."""
    return f".{target}.replaced-{unique}"


def export_temp(target: str, unique: str) -> str:
    """The hidden file an export to the file named ``target`` is written to."""
    return f".{target}.export-{unique}.tmp"


def in_flight_marker(save_id: str) -> str:
    """The marker of save ``save_id`` in flight, where its data files go straight into its target
    (URL storage): its temporary manifest's name, written empty by rank 0 before any data file (then,
    on filesystems with a rename, filled with the manifest and renamed over ``MANIFEST.json``; on
    object stores removed after the commit). The sweep of leftovers leaves every file of a save whose
    marker changed within the leftover age (on the storage's own clock)."""
    return temp_manifest(save_id)


def tier_incoming(entry: str, pid: int, unique: str) -> str:
    """The hidden folder of a transfer into the entry ``entry`` (a share or replica name) of a step folder
    (``unique``: 8 hex digits): :data:`TIER_INCOMING`."""
    return f".incoming-{entry}-{pid}-{unique}"


def is_tier_entry(name: str) -> bool:
    """Whether ``name`` is an entry the local tier writes in a step folder (a share, a replica, a transfer,
    a pending directory)."""
    return any(p.match(name) for p in (TIER_SHARE, TIER_REPLICA, TIER_INCOMING, TIER_PENDING))


def transfer_file(name: object) -> bool:
    """Whether a copy of a local-tier share may hold a file called ``name``: its manifest, a data file."""
    return isinstance(name, str) and (name == MANIFEST_NAME or DATA_FILE.match(name) is not None)


def clock_probe(probe_id: str) -> str:
    """The name of a sweep's clock probe (:data:`CLOCK_PROBE`)."""
    return f".shardsafe-clock-{probe_id}"


def commit_of(pending: str, target: str, save_id: str, manifest: bytes, files: Iterable[str]) -> Commit:
    """The :class:`~shardsafe.storage.base.Commit` of save ``save_id`` whose data files are ``files``
    (the manifest's own files), with the names the backend needs spelled here."""
    return Commit(pending, target, save_id, manifest, frozenset(files), temp_manifest(save_id))


def save_id_of(name: str) -> str | None:
    """The save id in a data file, temporary manifest or pending directory name; else ``None``."""
    for pattern in (DATA_FILE, TEMP_MANIFEST, PENDING_DIR):
        m = pattern.match(name)
        if m:
            return m.group("sid")
    return None


def basename(path: str) -> str:
    """The last component of a local path or URL."""
    return path.rstrip("/").rsplit("/", 1)[-1]


def is_own(name: str, *, in_pending: bool = False, in_export: bool = False) -> bool:
    """Whether shardsafe writes files called ``name`` inside a checkpoint (or inside a pending
    directory, where the staged manifest is shardsafe's too; or inside an export folder, where its
    marker is). ``MANIFEST.json`` of a checkpoint is not in this set: it is never deleted, only renamed
    to the tombstone. A side file (format v3) is shardsafe's only where a validated manifest lists it
    (:func:`listed_side_files`) or the save that wrote it names it; an export's files only where its
    marker lists them or the export that wrote them names them. Beside a target: a file export's
    hidden file."""
    if DATA_FILE.match(name) or TEMP_MANIFEST.match(name) or CLOCK_PROBE.match(name) or name == TOMBSTONE:
        return True
    if EXPORT_TEMP.match(name):
        return True
    return (in_pending and name in STAGED_MANIFEST) or (in_export and name == EXPORT_MARKER)


def is_export_folder(path: str) -> bool:
    """Whether ``path``'s own name is an export folder's while shardsafe owns it whole: hidden while
    written, or set aside once replaced (a published export has the user's name and its marker)."""
    name = basename(path)
    return EXPORT_HIDDEN.match(name) is not None or EXPORT_REPLACED.match(name) is not None


def plain_name(name: object) -> bool:
    """Whether ``name`` is a plain, visible file name (what an export may call its files): letters,
    digits, ``._-``, not starting with a dot, no ``..``, at most 255 characters."""
    return isinstance(name, str) and bool(_PLAIN.match(name)) and ".." not in name


_PLAIN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,254}\Z", re.ASCII)


def link_target(path: str) -> str | None:
    """Where ``path`` (a local path or ``file://`` URL) leads when its last component is a symbolic
    link (dangling or not); ``None`` when it is not one (object stores have no links)."""
    local = path.removeprefix("file://") if path.startswith("file://") else None if is_remote(path) else path
    if local is None:
        return None
    local = local.rstrip("/") or "/"
    return os.path.realpath(local) if os.path.islink(local) else None


def listed_side_files(storage: Storage, path: str) -> set[str]:
    """The side files (format v3) that the manifest and the tombstone in ``path`` list, each of them that
    validates (one that does not lists nothing: its names stay foreign)."""
    out: set[str] = set()
    for name in (MANIFEST_NAME, TOMBSTONE):
        where = storage.join(path, name)
        try:
            out.update(parse_manifest(storage.read_bytes(where), where).side_files)
        except (FileNotFoundError, NotADirectoryError, CorruptCheckpointError):
            continue
    return out


def refusal(storage: Storage, path: str, *, overwrite: bool, side_files: bool = False) -> str | None:
    """(rank 0, before a save starts) Why ``path`` may not receive a save, or ``None`` if it may:
    absent, an empty folder, or shardsafe's own names only, each a regular file (with
    ``MANIFEST.json``: a committed checkpoint, replaced only with ``overwrite``, and only by a save
    without ``side_files``, whose fixed names could not be replaced in the one atomic step of the
    commit). The side files a manifest or tombstone there lists are shardsafe's. A target that is a
    symbolic link is refused whatever it points to: saving through it would replace (and delete the
    files of) the checkpoint it points to, which a link's name does not own. The message lists a few
    of the foreign entries."""
    if not path.strip():
        return "an empty path names no folder; give the checkpoint's folder (e.g. 'checkpoints/step-100')"
    target = link_target(path)
    if target is not None:
        return (
            f"{path} is a symbolic link to {target}; shardsafe never saves through a link (an overwrite would "
            "replace the checkpoint it points to and delete that checkpoint's files). Save to the real path "
            f"({target}) if you mean to replace it, or remove the link (or save to a new path) and point the link "
            "at the new checkpoint afterwards"
        )
    if not storage.exists(path):
        return None
    if not storage.is_dir(path):
        return f"{path} exists and is not a directory; save to a new path (shardsafe never replaces other files)"
    kinds = storage.entries(path)
    foreign = [
        n if kind == "file" else f"{n} ({_KIND_WORDS.get(kind, kind)})"
        for n, kind in sorted(kinds.items())
        if kind != "file" or (n != MANIFEST_NAME and not is_own(n))
    ]
    names = sorted(kinds)
    if foreign:
        listed = listed_side_files(storage, path)
        foreign = [n for n in foreign if n not in listed]
    if foreign:
        shown = ", ".join(repr(n) for n in foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        return (
            f"{path} is a folder that holds files shardsafe did not write ({shown}); it refuses to save there "
            "whatever overwrite= says, so that nothing of yours is deleted or replaced. Save to a new path or to "
            "an empty folder."
        )
    if MANIFEST_NAME in names and not overwrite:
        return (
            f"{path} already holds a committed checkpoint; pass overwrite=True to replace it atomically, or save "
            "to a new path"
        )
    if MANIFEST_NAME in names and side_files:
        return (
            f"{path} holds a committed checkpoint, and this save carries side files (files=/write_files=), whose "
            "fixed names cannot be replaced in the commit's one atomic step (the old checkpoint would not stay "
            "whole until the new one is committed); save to a new path, or delete the old one first "
            "(shardsafe.delete)"
        )
    return None


_KIND_WORDS = {"dir": "a folder", "link": "a symbolic link", "other": "not a regular file"}
