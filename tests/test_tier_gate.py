"""The local tier's removals and publishes go through the catalog (the delete gate, the publication
transaction): a name the tier did not write is refused before anything is removed, nothing is removed
through a symbolic link, and a transfer writes only the files a share holds."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, BinaryIO

import pytest
import torch

import shardsafe
from shardsafe.deadline import Deadline
from shardsafe.errors import CheckpointError, InternalError
from shardsafe.format.names import data_file
from shardsafe.manager import replica
from shardsafe.manager.tiers import new_save_id, remove_entry, share_name, step_folder

RUN = "0123456789abcdef"


def test_an_entry_outside_a_step_folder_is_refused_and_its_folder_stays(tmp_path: Path) -> None:
    """Before, the entry's files and the entry went, then the folder holding it (``mine``, not a step
    folder of the tier) was removed too once empty."""
    entry = tmp_path / "mine" / share_name(1)
    entry.mkdir(parents=True)
    (entry / data_file(0, "abc")).write_bytes(b"x")
    with pytest.raises(InternalError, match="not a name the local tier writes"):
        remove_entry(str(entry), RUN)
    assert sorted(os.listdir(entry)) == [data_file(0, "abc")]


def test_the_emptied_step_folder_goes_and_a_foreign_entry_name_is_refused(tmp_path: Path) -> None:
    where = Path(step_folder(str(tmp_path), RUN, 3, new_save_id(), create=True))
    entry = where / share_name(1)
    entry.mkdir()
    (entry / data_file(0, "abc")).write_bytes(b"x")
    assert remove_entry(str(entry), RUN)
    assert not where.exists() and where.parent.is_dir()
    with pytest.raises(InternalError):
        remove_entry(str(tmp_path / "notes"), RUN)


class _SwapsItsFolder:
    """A stream that, once the first file is open, replaces the transfer's hidden folder with a symbolic
    link to ``victim`` and breaks."""

    def __init__(self, where: Path, victim: Path) -> None:
        self.where, self.victim = where, victim

    def into(self, f: BinaryIO, size: int, what: str) -> None:
        (hidden,) = [p for p in self.where.iterdir() if p.name.startswith(".incoming-")]
        hidden.rename(self.where / "aside")
        hidden.symlink_to(self.victim, target_is_directory=True)
        raise CheckpointError("the replica connection was closed by the other side")


def test_a_failed_transfer_deletes_nothing_through_a_link(tmp_path: Path) -> None:
    """Before, the failed transfer unlinked the file it had written by its path in its hidden folder,
    which by then led through the link: the user's file of that name went."""
    where = Path(step_folder(str(tmp_path / "node"), RUN, 3, new_save_id(), create=True))
    victim = tmp_path / "victim"
    victim.mkdir()
    name = data_file(0, "1700000000abcdef0123")
    (victim / name).write_bytes(b"the user's")
    files = [[name, 10], ["MANIFEST.json", 5]]
    stream: Any = _SwapsItsFolder(where, victim)
    with pytest.raises(CheckpointError, match="closed by the other side"):
        replica.receive_checkpoint(stream, str(where), share_name(1), files, {}, Deadline.after(60, "io"))
    assert (victim / name).read_bytes() == b"the user's"
    assert os.listdir(where / "aside") == [name]  # what the transfer wrote stays where it went (logged)


def test_a_push_naming_a_file_a_share_does_not_hold_is_refused_before_any_byte(tmp_path: Path) -> None:
    """Before, the server accepted the request (and would have written ``notes.txt`` into the node folder)."""
    save = new_save_id()
    meta: dict[str, Any] = {"step": 3, "rank": 1, "world_size": 2, "run": RUN, "save": save, "incarnation": "0" * 16}
    server = replica.ReplicaServer(str(tmp_path / "node"), 0, "127.0.0.1")
    try:
        host, port = server.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            stream = replica._Stream(sock, float("inf"), 30.0)
            stream.send(server.token.encode() + b"\n")
            head = {"op": "push", "run": RUN, "step": 3, "save": save, "rank": 1, "metadata": meta}
            stream.send_line({**head, "files": [["notes.txt", 3], ["MANIFEST.json", 5]]})
            answer = stream.line()
        assert answer["ok"] is False and "notes.txt" in answer["error"], answer
        assert not list((tmp_path / "node").rglob("notes.txt"))
    finally:
        server.close()


def test_a_replica_still_arrives_whole(tmp_path: Path) -> None:
    save = new_save_id()
    meta = {"step": 3, "rank": 1, "world_size": 2, "run": RUN, "save": save, "incarnation": "0" * 16}
    share = str(tmp_path / "share")
    shardsafe.save(share, {"w": torch.arange(8.0)}, metadata=meta)
    server = replica.ReplicaServer(str(tmp_path / "node"), 0, "127.0.0.1")
    try:
        replica.push(server.address, server.token, share, meta, Deadline.after(60, "io"))
    finally:
        server.close()
    (copy,) = (tmp_path / "node").rglob("replica-of-rank-00001")
    assert shardsafe.verify(str(copy)) and not list(copy.parent.glob(".incoming-*"))
