"""The public surface: the checkpoint API, the types it returns, its errors and the checkpoint manager,
and nothing else at the top level. The training runtime and the Fabric strategies are subpackages a
program imports itself; using the checkpoint API does not load them."""

from __future__ import annotations

import subprocess
import sys

import shardsafe

API = {
    "save",
    "async_save",
    "load",
    "verify",
    "inspect",
    "read_file",
    "side_files_folder",
    "delete",
    "export_hf",
    "export_torch",
    "import_checkpoint",
}
TYPES = {
    "SaveHandle",
    "SaveOptions",
    "CheckpointInfo",
    "EntryInfo",
    "VerifySummary",
    "Progress",
    "ProgressBar",
    "ExportResult",
    "ImportResult",
    "per_rank",
    "RNGState",
}
MANAGER = {"CheckpointManager", "CheckpointRecord", "LocalTier", "ManagerConfig"}


def test_the_top_level_is_the_api_its_types_errors_and_the_manager() -> None:
    errors = {n for n in shardsafe.__all__ if n.endswith("Error")}
    assert set(shardsafe.__all__) == API | TYPES | MANAGER | errors | {"__version__"}
    for name in shardsafe.__all__:
        assert getattr(shardsafe, name) is not None, name
    assert not {"Runtime", "LaunchError", "WorkerError", "PerRank"} & set(shardsafe.__all__)
    assert issubclass(shardsafe.TornSnapshotError, shardsafe.CheckpointError)  # async_save(staging="background")


def test_using_the_checkpoint_api_loads_neither_the_runtime_nor_fabric(tmp_path: object) -> None:
    code = (
        "import sys, torch, shardsafe\n"
        f"shardsafe.save({str(tmp_path)!r} + '/c', {{'w': torch.zeros(2)}})\n"
        f"shardsafe.load({str(tmp_path)!r} + '/c')\n"
        "loaded = [m for m in ('shardsafe.runtime', 'shardsafe.fabric', 'lightning') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
        "from shardsafe.runtime import Runtime, LaunchError, WorkerError\n"
        "assert issubclass(LaunchError, shardsafe.CheckpointError)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
