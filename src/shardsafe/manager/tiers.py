"""The node-local tier's configuration and layout: :class:`LocalTier`, the node identity, the names of a
run's folders, and what each rank may delete (docs/tiers.md).

Layout of one node's folder (``path_template`` with ``{node}`` replaced)::

    run-<run id>/                                   one run's entries (the run: manager/lineage.py)
      step-00000012-<save id>/rank-00003            rank 3's share of step 12, save <save id>
      step-00000012-<save id>/replica-of-rank-00001 a byte-identical copy of rank 1's share, sent by rank 1
      step-00000012-<save id>/.incoming-...         a transfer in progress (never read)
      step-00000012-<save id>/.rank-00003.staging-* the pending directory of a share being saved
    run-<another id>/                               another run's: never read, never deleted

Every share records its step, rank, number of ranks, run, save and incarnation (its metadata); a copy
counts only where its metadata matches its place, and a step only when every rank's share comes from one
save. A save writes a fresh ``step-N-<save id>`` folder, so it never replaces an entry of another save.

Who deletes what: each entry names a rank R (``rank-R``, ``replica-of-rank-R``, a transfer or pending
directory of one of those); in a node folder the ranks of the node now (``members``, rank order) share
them out, R going to ``members[R % len(members)]``. Node numbers never decide what belongs to whom: an
entry left by a job whose ranks sat on other nodes is still some member's to verify and to delete. A
committed entry is deleted only when its manifest validates and names this run; nothing is read or
deleted through a symbolic link (a run, step or entry folder that is one is left alone, with a warning),
and nothing is removed recursively."""

from __future__ import annotations

import logging
import os
import re
import secrets
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass

from shardsafe.catalog import unlink
from shardsafe.catalog.delete import delete_checkpoint, delete_files, finish_deletion, refuse_link, remove_pending
from shardsafe.catalog.names import TIER_INCOMING, TIER_PENDING, TIER_REPLICA, TIER_SHARE, TIER_STEP, is_own
from shardsafe.engine import api
from shardsafe.errors import CheckpointError, InternalError, InvalidArgumentError, UnsafePathError
from shardsafe.storage.local import LocalStorage

logger = logging.getLogger(__name__)

RUN_ID = re.compile(r"^[0-9a-f]{16}\Z")
SAVE_ID = re.compile(r"^[0-9]{10}[0-9a-f]{10}\Z")
RUN_RE = re.compile(r"^run-([0-9a-f]{16})\Z")
# The names of a node folder's step folders and their entries: the catalog's grammar (catalog/names.py),
# which the delete gate checks before any removal.
STEP_RE, SHARE_RE, REPLICA_RE, INCOMING_RE, PENDING_RE = (
    TIER_STEP,
    TIER_SHARE,
    TIER_REPLICA,
    TIER_INCOMING,
    TIER_PENDING,
)


@dataclass(frozen=True)
class LocalTier:
    """A fast checkpoint tier on each node's own disk (or RAM disk), replicated to peer nodes.

    ``path_template``: a local folder; ``{node}`` in it is replaced by the node identity
    (:func:`node_identity`), so one machine can simulate several nodes. ``every_n_steps``: a local save
    every so many steps (``CheckpointManager.maybe_save``). ``replicas``: how many other nodes receive a
    copy of each rank's share (0: none; a lost node then loses its steps). ``keep``: how many steps each
    node keeps; local copies of steps older than the newest durable checkpoint are dropped first."""

    path_template: str
    every_n_steps: int
    replicas: int = 1
    keep: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.path_template, str) or not self.path_template:
            raise InvalidArgumentError(f"LocalTier path_template={self.path_template!r} must be a local folder path")
        if "://" in self.path_template:
            raise InvalidArgumentError(
                f"LocalTier path_template={self.path_template!r} must be a node-local folder, not a URL; the "
                "durable store is the CheckpointManager's root"
            )
        for name, least in (("every_n_steps", 1), ("replicas", 0), ("keep", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise InvalidArgumentError(f"LocalTier {name}={value!r} must be an integer >= {least}")

    def folder(self, node: str) -> str:
        """The folder of node ``node``."""
        return os.path.abspath(self.path_template.replace("{node}", node))


def node_identity(environ: Mapping[str, str] | None = None) -> str:
    """This process's node: ``SHARDSAFE_NODE``, else torchrun's ``GROUP_RANK``, else SLURM's
    ``SLURM_NODEID``, else ``"0"`` (one node)."""
    env = os.environ if environ is None else environ
    for key in ("SHARDSAFE_NODE", "GROUP_RANK", "SLURM_NODEID"):
        value = env.get(key, "").strip()
        if value:
            if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", value):
                raise InvalidArgumentError(
                    f"{key}={value!r} cannot name a node folder; use letters, digits, '_', '.', '-'"
                )
            return value
    return "0"


def peers(nodes: list[str], rank: int, replicas: int) -> list[int]:
    """The ranks that receive ``rank``'s replicas, ``nodes[r]`` being rank r's node: on each of the next
    ``replicas`` nodes (in sorted order, wrapping around, never its own), the rank at the same position
    among its node's ranks (modulo their number). Fewer when there are fewer other nodes. Where a copy
    goes only: what belongs to whom is the copy's metadata."""
    order = sorted(set(nodes))
    members = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}
    mine = nodes[rank]
    position = members[mine].index(rank)
    out: list[int] = []
    for k in range(1, min(replicas, len(order) - 1) + 1):
        other = members[order[(order.index(mine) + k) % len(order)]]
        out.append(other[position % len(other)])
    return out


# ------------------------------------------------------------------------------------------ names


def new_run_id() -> str:
    return secrets.token_hex(8)


def new_save_id() -> str:
    """A local save's id: its time (so saves of one step order by it) and 40 random bits."""
    return f"{int(time.time()):010d}{secrets.token_hex(5)}"


def run_name(run: str) -> str:
    return f"run-{run}"


def step_name(step: int, save: str) -> str:
    return f"step-{step:08d}-{save}"


def share_name(rank: int) -> str:
    return f"rank-{rank:05d}"


def replica_name(rank: int) -> str:
    return f"replica-of-rank-{rank:05d}"


def entry_rank(name: str) -> int | None:
    """The rank an entry of a step folder names (its share, its replica, a transfer or a pending
    directory of one), else ``None`` (a name the local tier does not write)."""
    for pattern in (SHARE_RE, REPLICA_RE, INCOMING_RE, PENDING_RE):
        m = pattern.match(name)
        if m:
            return int(m.group(1))
    return None


def handler(members: list[int], rank: int) -> int:
    """The rank of the node (``members``, in rank order) that verifies and deletes the entries naming
    rank ``rank`` in the node's folder."""
    return members[rank % len(members)]


def real_dir(path: str) -> bool:
    """Whether ``path`` is a folder itself (not a symbolic link to one, not a file)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


_warned: set[str] = set()


def warn_once(path: str, why: str) -> None:
    """One WARNING per path and process: what the local tier leaves alone there, and why."""
    if path not in _warned:
        _warned.add(path)
        logger.warning("shardsafe: local tier: %s %s", path, why)


def run_folder(folder: str, run: str, *, create: bool = False) -> str:
    """The folder of run ``run`` in a node folder (made with ``create``); :class:`CheckpointError` when
    it is a symbolic link or not a folder (nothing is written or read through a link)."""
    path = os.path.join(folder, run_name(run))
    if create and not os.path.lexists(path):
        os.makedirs(path, exist_ok=True)
    if os.path.lexists(path) and not real_dir(path):
        raise UnsafePathError(
            f"{path} is a symbolic link or not a folder; the local tier reads and writes nothing through a link. "
            "Move it away and save again"
        )
    return path


def step_folder(folder: str, run: str, step: int, save: str, *, create: bool = False) -> str:
    """The folder of save ``save`` of ``step`` in run ``run`` (as :func:`run_folder`)."""
    path = os.path.join(run_folder(folder, run, create=create), step_name(step, save))
    if create and not os.path.lexists(path):
        os.makedirs(path, exist_ok=True)
    if os.path.lexists(path) and not real_dir(path):
        raise UnsafePathError(
            f"{path} is a symbolic link or not a folder; the local tier reads and writes nothing through a link. "
            "Move it away and save again"
        )
    return path


def saves_in(folder: str, run: str) -> list[tuple[int, str]]:
    """``(step, save id)`` of the step folders of run ``run`` in a node folder, newest first; a name the
    local tier does not write, or a link, is skipped (with a warning)."""
    where = os.path.join(folder, run_name(run))
    if not real_dir(where):
        if os.path.lexists(where):
            warn_once(where, "is a symbolic link or not a folder: never read nor deleted through; move it away")
        return []
    out: list[tuple[int, str]] = []
    for n in sorted(os.listdir(where)):
        m = STEP_RE.match(n)
        path = os.path.join(where, n)
        if m is None:
            warn_once(path, "is not a name the local tier writes: left as it is")
        elif not real_dir(path):
            warn_once(path, "is a symbolic link or not a folder: never read nor deleted through; left as it is")
        else:
            out.append((int(m.group(1)), m.group(2)))
    return sorted(out, reverse=True)


def foreign(folder: str, run: str | None) -> None:
    """(the first rank of a node) Warn about everything in the node folder that is not run ``run``'s:
    other runs' folders, steps of the layout before runs were recorded, anything else. Never read,
    never deleted."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return
    for n in names:
        path = os.path.join(folder, n)
        m = RUN_RE.match(n)
        if m and m.group(1) == run:
            continue
        if m:
            warn_once(
                path,
                f"belongs to another run ({m.group(1)}; this run is {run or 'not recorded yet'}): this run never "
                "uses nor deletes it. Remove it by hand once that run is over",
            )
        elif n.startswith("step-"):
            warn_once(
                path,
                "belongs to another run (saved before the local tier recorded runs): this run never uses nor "
                "deletes it. Remove it by hand once it is not needed",
            )
        else:
            warn_once(path, "is not a name the local tier writes: never used nor deleted")


# ----------------------------------------------------------------------------------------- delete


def _run_of(path: str) -> object:
    """The run a committed entry's manifest records (raises :class:`CheckpointError` when the manifest
    does not validate)."""
    meta = api.inspect(path).metadata
    return meta.get("run") if isinstance(meta, dict) else None


def remove_entry(path: str, run: str) -> bool:
    """Delete one entry of a step folder of run ``run``; returns whether it went. A committed entry goes
    only when its manifest validates (else :class:`CheckpointError`) and names run ``run`` (else it
    stays, with a warning: ``False``). An entry without a committed manifest (a save or a delete that
    crashed, a transfer) loses only the names shardsafe writes (after finishing an interrupted delete),
    and goes if that empties it; a pending directory, only its save's files. A link (the entry, its step
    or run folder) raises ``ValueError`` or :class:`CheckpointError`, deleting nothing; a name the local
    tier does not write (the entry's or its step folder's), :class:`InternalError`, before anything is
    deleted. Then the step folder goes, if empty. Every removal passes the delete gate
    (:mod:`shardsafe.catalog.unlink`)."""
    name = os.path.basename(path)
    step_dir = os.path.dirname(path)
    if entry_rank(name) is None or STEP_RE.match(os.path.basename(step_dir)) is None:
        raise InternalError(
            f"refusing to delete {path!r}: not a name the local tier writes in a step folder (a bug: please report it)"
        )
    for where in (os.path.dirname(step_dir), step_dir):
        if not real_dir(where):
            raise UnsafePathError(f"refusing to delete {path}: {where} is a symbolic link or not a folder")
    refuse_link(path, "delete the local-tier entry")
    if not real_dir(path):
        raise UnsafePathError(f"refusing to delete {path}: not a folder (the local tier writes folders there)")
    storage = LocalStorage()
    if PENDING_RE.match(name):
        gone = remove_pending(storage, path)
    else:
        if os.path.lexists(os.path.join(path, "MANIFEST.json")):
            if _run_of(path) != run:
                warn_once(path, f"belongs to another run (its metadata), not to run {run}: never used nor deleted")
                return False
            try:
                delete_checkpoint(storage, path)
            except FileNotFoundError:
                if os.path.lexists(path):
                    raise
        gone = not os.path.lexists(path)
        if not gone:
            finish_deletion(storage, path)  # an interrupted delete: what its tombstone lists
            delete_files(storage, path, [n for n in os.listdir(path) if is_own(n)])
            gone = unlink.remove_tier_folder(path)
            if not gone:
                warn_once(path, "holds files shardsafe did not write; left as it is")
    try:
        unlink.remove_tier_folder(step_dir)  # False: other entries are still there
    except OSError as err:  # the entry is gone; the empty step folder is never read as a save
        warn_once(step_dir, f"is empty and could not be removed ({type(err).__name__}: {err}); remove it by hand")
    return gone


def _drop(folder: str, run: str, step: int, save: str, rank: int, members: list[int], only_leftovers: bool) -> None:
    """Delete the entries of one step folder that ``rank`` handles (only the transfers and pending
    directories with ``only_leftovers``). A failure is logged with the path and the fix, never raised."""
    where = os.path.join(folder, run_name(run), step_name(step, save))
    try:
        names = sorted(os.listdir(where))
    except OSError:
        return
    for n in names:
        r = entry_rank(n)
        if r is None:
            warn_once(os.path.join(where, n), "is not a name the local tier writes: left as it is")
            continue
        if handler(members, r) != rank or (only_leftovers and not (INCOMING_RE.match(n) or PENDING_RE.match(n))):
            continue
        path = os.path.join(where, n)
        try:
            remove_entry(path, run)
        except (OSError, ValueError, CheckpointError) as err:
            logger.warning(
                "shardsafe: local tier: could not delete %s (%s: %s); it is never used again (every copy names "
                "its save), so the job goes on. Remove it by hand if it stays",
                path,
                type(err).__name__,
                err,
            )


def retain(
    folder: str, run: str, rank: int, members: list[int], keep: int, durable: int | None, newest: int, save: str
) -> None:
    """(each rank, after save ``save`` of step ``newest`` completed on every rank) Delete the entries this
    rank handles of: other saves of ``newest``; steps beyond the ``keep`` newest; steps older than the
    newest durable checkpoint ``durable``. Newer steps are left (resume removes them). Failures are
    logged: the new step is safe."""
    found = saves_in(folder, run)
    kept = sorted({s for s, _ in found if s <= newest}, reverse=True)[:keep]
    for step, sid in found:
        if step > newest or (step, sid) == (newest, save):
            continue
        stays = step != newest and step in kept and (durable is None or step >= durable)
        _drop(folder, run, step, sid, rank, members, only_leftovers=stays)


def forget(folder: str, run: str, rank: int, members: list[int], step: int | None, save: str | None) -> None:
    """(each rank, once a resume decided ``step``; ``save``: the local save it loaded, if any) Delete the
    entries this rank handles of the steps newer than ``step`` (all steps for ``None``), of other saves
    of ``step`` when it came from the local tier, and every leftover transfer or pending directory: a
    later save of those steps starts clean. Failures are logged, never raised."""
    for s, sid in saves_in(folder, run):
        newer = step is None or s > step or (save is not None and s == step and sid != save)
        _drop(folder, run, s, sid, rank, members, only_leftovers=not newer)
