"""One grammar for save ids and data file names: every save id the manifest accepts (the format's
``1 to 128 of A-Z a-z 0-9 . _ -``) names data files that the catalog recognises as shardsafe's own,
so the delete rule can remove what such a save wrote; and no near-miss name is taken for one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shardsafe.catalog.delete import discard_save
from shardsafe.catalog.names import PENDING_DIR, TEMP_MANIFEST, is_own, pending_name, save_id_of, temp_manifest
from shardsafe.format.names import SAVE_ID, data_file
from shardsafe.storage.local import LocalStorage

SPEC_VALID = ["a.b", "run_1-final", "x" * 128, "0", "1795355225a1b2c3d4e5", "..-_"]


@pytest.mark.parametrize("sid", SPEC_VALID)
def test_every_spec_valid_save_id_names_files_the_catalog_owns(sid: str) -> None:
    assert SAVE_ID.match(sid)
    assert is_own(data_file(3, sid)) and save_id_of(data_file(3, sid)) == sid
    assert is_own(temp_manifest(sid)) and TEMP_MANIFEST.match(temp_manifest(sid))
    m = PENDING_DIR.match(pending_name("step-100", sid))
    assert m is not None and m["sid"] == sid and m["target"] == "step-100"


@pytest.mark.parametrize(
    "name",
    [
        "data-00000-a.b.safetensors\n",  # a trailing newline is another name
        "data-0000-ab.safetensors",
        "data-00000-a/b.safetensors",
        "data-00000-" + "x" * 129 + ".safetensors",
        "data-00000-.safetensors",
        "model.safetensors",
        "MANIFEST.json",
    ],
)
def test_near_misses_are_not_shardsafe_files(name: str) -> None:
    assert not is_own(name)


def test_a_failed_save_with_a_dotted_save_id_is_discarded_and_nothing_else(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    target.mkdir()
    sid = "a.b"
    mine = [data_file(r, sid) for r in range(2)] + [temp_manifest(sid)]
    for name in [*mine, "notes.txt", data_file(0, "other")]:
        (target / name).write_bytes(b"x")
    discard_save(LocalStorage(), str(target), str(target), sid, 2)
    assert sorted(os.listdir(target)) == sorted(["notes.txt", data_file(0, "other")])
