"""One home per concept: every storage backend has the same shape (what the engine and the manager
need), and the CLI and ``ls`` share one set of table and size helpers."""

from __future__ import annotations

import inspect
from pathlib import Path

from shardsafe.display import binary_size, exact_size, table
from shardsafe.storage.base import Storage
from shardsafe.storage.local import LocalStorage
from shardsafe.storage.remote import FsspecStorage


def _public_methods(cls: type) -> set[str]:
    return {n for n, v in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")}


def test_local_and_remote_storage_have_the_same_shape_as_the_protocol() -> None:
    wanted = {n for n in vars(Storage) if not n.startswith("_") and callable(getattr(Storage, n))}
    assert {"mtime", "total_size", "is_dir", "list_dir", "size", "publish"} <= wanted
    for backend in (LocalStorage, FsspecStorage):
        missing = wanted - _public_methods(backend)
        assert not missing, (backend.__name__, missing)
        for name in wanted:
            theirs = list(inspect.signature(getattr(backend, name)).parameters)
            ours = list(inspect.signature(getattr(Storage, name)).parameters)
            assert theirs == ours, (backend.__name__, name, theirs, ours)


def test_local_storage_sizes_and_ages_a_directory_for_the_listing(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"x" * 10)
    (tmp_path / "b").write_bytes(b"y" * 5)
    (tmp_path / "sub").mkdir()
    st = LocalStorage()
    assert st.total_size(str(tmp_path)) == 15 and st.total_size(str(tmp_path / "a")) == 10
    assert st.mtime(str(tmp_path)) >= (tmp_path / "a").stat().st_mtime


def test_sizes_and_tables_read_the_same_in_the_cli_and_ls() -> None:
    assert [binary_size(n) for n in (0, 512, 1024, 3 * 2**20)] == ["0 B", "512 B", "1.0 KiB", "3.0 MiB"]
    assert exact_size(100) == "100 bytes" and exact_size(3 * 2**20) == "3145728 bytes (3.0 MiB)"
    rows = [("NAME", "N", "NOTE"), ("a", "10", "x y"), ("bbb", "2", "")]
    assert table(rows, right=(1,)) == ["NAME   N  NOTE", "a     10  x y", "bbb    2"]
    assert table(rows, pad_last=False) == ["NAME  N   NOTE", "a     10  x y", "bbb   2"]
