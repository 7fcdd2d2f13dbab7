"""The node-local tier's configuration and layout: :class:`LocalTier`, the node identity, the folder
names of a step, and what each rank may delete (docs/tiers.md).

Layout of one node's folder (``path_template`` with ``{node}`` replaced)::

    step-00000012/rank-00003               rank 3's share of step 12 (a one-process shardsafe checkpoint)
    step-00000012/replica-of-rank-00001    a byte-identical copy of rank 1's share, sent by rank 1
    step-00000012/.incoming-...            a transfer in progress (never read; removed by its receiver)

Each entry belongs to exactly one rank of the node, the only one that writes or deletes it: ``rank-R``
to rank R, ``replica-of-rank-R`` to the rank that receives R's replicas (:func:`peers`), and an
``.incoming-`` folder to the rank named in it."""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass

from shardsafe.catalog.delete import delete_checkpoint, delete_files, finish_deletion, refuse_link
from shardsafe.catalog.names import is_own
from shardsafe.errors import InternalError, InvalidArgumentError
from shardsafe.storage.local import LocalStorage

logger = logging.getLogger(__name__)

STEP_RE = re.compile(r"^step-(\d{8,})$")
SHARE_RE = re.compile(r"^rank-(\d{5,})$")
REPLICA_RE = re.compile(r"^replica-of-rank-(\d{5,})$")
INCOMING_RE = re.compile(r"^\.incoming-(?:rank|replica-of-rank)-\d{5,}-to-(\d{5,})-\d+-[0-9a-f]{8}$")


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
    among its node's ranks (modulo their number). Fewer when there are fewer other nodes."""
    order = sorted(set(nodes))
    members = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}
    mine = nodes[rank]
    position = members[mine].index(rank)
    out: list[int] = []
    for k in range(1, min(replicas, len(order) - 1) + 1):
        other = members[order[(order.index(mine) + k) % len(order)]]
        out.append(other[position % len(other)])
    return out


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def share_name(rank: int) -> str:
    return f"rank-{rank:05d}"


def replica_name(rank: int) -> str:
    return f"replica-of-rank-{rank:05d}"


def steps_in(folder: str) -> list[int]:
    """The steps with a folder in ``folder``, newest first."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    return sorted((int(m.group(1)) for n in names if (m := STEP_RE.match(n))), reverse=True)


def owned(folder: str, step: int, rank: int, senders: list[int]) -> list[str]:
    """The entries of ``step`` in ``folder`` that ``rank`` owns: its share and the replicas of
    ``senders`` (the ranks that send it theirs)."""
    where = os.path.join(folder, step_name(step))
    mine = {share_name(rank), *(replica_name(s) for s in senders)}
    try:
        return sorted(os.path.join(where, n) for n in os.listdir(where) if n in mine)
    except FileNotFoundError:
        return []


def remove_entry(path: str) -> None:
    """Delete one committed share or replica (validated by its manifest; a link is refused); a share
    or replica folder without a committed manifest (a save that crashed) loses only the names shardsafe
    writes there, and goes if that empties it; an ``.incoming-`` folder (a transfer that crashed, its
    name unique to that transfer) goes whole. Then the step folder, if empty."""
    name = os.path.basename(path)
    if not (SHARE_RE.match(name) or REPLICA_RE.match(name) or INCOMING_RE.match(name)):
        raise InternalError(f"refusing to delete {path!r}: not a name the local tier writes (a bug: please report it)")
    refuse_link(path, "delete the local-tier entry")
    storage = LocalStorage()
    if os.path.exists(os.path.join(path, "MANIFEST.json")) and not INCOMING_RE.match(name):
        try:
            delete_checkpoint(storage, path)
        except FileNotFoundError:
            if os.path.lexists(path):
                raise  # else: the entry is gone and a rank of the node removed the empty step folder meanwhile
    if os.path.isdir(path) and INCOMING_RE.match(name):
        shutil.rmtree(path)  # a transfer's own folder: only a transfer writes there
    elif os.path.isdir(path):
        finish_deletion(storage, path)  # an interrupted delete: what its tombstone lists
        own = [n for n in os.listdir(path) if is_own(n)]
        delete_files(storage, path, own)
        if not storage.remove_dir_if_empty(path):
            logger.warning("shardsafe: local tier: %s holds files shardsafe did not write; left as it is", path)
    try:
        os.rmdir(os.path.dirname(path))
    except OSError:
        pass  # other ranks' entries are still there


def drop_old(folder: str, rank: int, senders: list[int], keep: int, durable: int | None, newest: int) -> None:
    """(each rank, after a local save of ``newest`` committed on every rank) Delete this rank's entries
    of the steps beyond the ``keep`` newest, and of steps older than the newest durable checkpoint
    ``durable``. Failures are logged: the new step is safe."""
    steps = steps_in(folder)
    kept = [s for s in steps if s <= newest][:keep]
    for step in steps:
        if step in kept and (durable is None or step >= durable):
            continue
        if step > newest:
            continue  # not reached: newer steps are removed at resume (drop_newer)
        for path in owned(folder, step, rank, senders):
            try:
                remove_entry(path)
            except (OSError, ValueError) as err:
                logger.error("shardsafe: local tier retention could not delete %s: %s", path, err)


def drop_newer(folder: str, rank: int, senders: list[int], step: int | None) -> None:
    """(each rank, once resume decided) Delete this rank's entries of steps newer than ``step`` (all of
    them for ``None``) and its leftover transfers: a later save of those steps must never meet a share
    of the abandoned run (a step mixed from two saves)."""
    for s in steps_in(folder):
        where = os.path.join(folder, step_name(s))
        try:
            names = os.listdir(where)
        except FileNotFoundError:
            continue
        for n in names:
            m = INCOMING_RE.match(n)
            if m and int(m.group(1)) == rank:
                remove_entry(os.path.join(where, n))
        if step is None or s > step:
            for path in owned(folder, s, rank, senders):
                remove_entry(path)
