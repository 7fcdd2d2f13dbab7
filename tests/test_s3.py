"""End to end on a real S3 endpoint (moto on the loopback interface, s3fs as the client): saves and
loads on 2 ranks through ``shardsafe.save/load(..., storage_options=...)``, resharding, overwrite, a
rank killed mid-upload, transient faults on every rank, and the manager and the CLI on ``s3://``."""

from __future__ import annotations

# ruff: noqa: F811  (the S3 fixtures are imported from conftest_s3 and named as test parameters)
import json
from typing import Any

import torch

import shardsafe
from shardsafe.catalog.delete import delete_files
from shardsafe.storage import MANIFEST_NAME
from shardsafe.storage.remote import FsspecStorage
from shardsafe.storage.retry import RetryPolicy
from shardsafe.storage.uploads import list_uploads

from conftest_s3 import FAULTS_ENV, PART, FlakyS3FileSystem, s3_bucket, s3_server  # noqa: F401
from harness import check_ok, run_ranks
from models import assert_same, build, full_state, needs_fsdp2_on_cpu, train
from s3_server import S3Server

# Small parts, so that data files of a few MiB upload as parallel multipart parts.
ENV = {"SHARDSAFE_REMOTE_PART_BYTES": str(PART)}
BIG = 3 * PART // 4 + 5  # float32 elements: 3 parts and a bit per extra tensor


def _state(model: Any, opt: Any, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    extra = {f"extra{i}": torch.randn(BIG, generator=g) for i in range(2)}  # replicated, one per rank
    return {"model": model, "optimizer": opt, "step": 2, "extra": extra}


def _register_flaky() -> None:
    import fsspec

    fsspec.register_implementation("flakys3", FlakyS3FileSystem, clobber=True)


def _save(url: str, opts: dict[str, Any], strategy: str, seed: int, *, overwrite: bool, timeout: float = 60) -> Any:
    model, opt = build(strategy, seed=seed)
    train(model, opt, 2)
    state = _state(model, opt, seed)
    shardsafe.save(url, state, overwrite=overwrite, storage_options=opts, timeout=timeout)
    return {**full_state(model, opt), **{f"extra/{k}": v for k, v in state["extra"].items()}}


def _load(url: str, opts: dict[str, Any], strategy: str) -> Any:
    model, opt = build(strategy, seed=123)  # everything must come from the checkpoint
    state = _state(model, opt, 999)
    state["step"] = 0
    shardsafe.load(url, state, storage_options=opts, timeout=60)
    assert state["step"] == 2
    return {**full_state(model, opt), **{f"extra/{k}": v for k, v in state["extra"].items()}}


def _save_then_load(rank: int, world: int, url: str, opts: dict[str, Any], strategy: str) -> tuple[Any, Any]:
    _register_flaky()
    return _save(url, opts, strategy, 0, overwrite=False), _load(url, opts, strategy)


def _save_overwrite_load(rank: int, world: int, url: str, opts: dict[str, Any]) -> tuple[str, Any, Any]:
    _save(url, opts, "ddp", 0, overwrite=False)
    first = shardsafe.inspect(url, storage_options=opts).save_id
    try:
        _save(url, opts, "ddp", 1, overwrite=False)
        refused = "not refused"
    except shardsafe.CheckpointExistsError as err:
        refused = str(err)
    second = _save(url, opts, "ddp", 1, overwrite=True)
    assert shardsafe.inspect(url, storage_options=opts).save_id != first
    return refused, second, _load(url, opts, "ddp")


def _overwrite_save(rank: int, world: int, url: str, opts: dict[str, Any]) -> Any:
    return _save(url, opts, "ddp", 1, overwrite=True, timeout=10)


def _manager_run(rank: int, world: int, root: str) -> dict[str, Any]:
    """Steps 1-4 with keep_last=2; then the newest checkpoint loses a data object; then a fresh
    manager resumes (from step 3, the newest intact one)."""
    import torch.distributed as dist

    from shardsafe.manager import CheckpointManager

    model, opt = build("ddp", seed=0)
    state: dict[str, Any] = {"model": model, "optimizer": opt, "step": 0}
    out: dict[str, Any] = {}
    with CheckpointManager(root, every_n_steps=1, keep_last=2, save_on_signals=(), timeout=60) as mgr:
        for step in range(1, 5):
            train(model, opt, 1, start=step)
            state["step"] = step
            assert mgr.maybe_save(step, state)
            if step == 3:
                out["at3"] = full_state(model, opt)
    dist.barrier()  # retention runs on rank 0 after each commit; look once every rank is done
    st = FsspecStorage.for_path(root)
    out["kept"] = st.list_dir(root)
    dist.barrier()
    if rank == 0:
        newest = f"{root}/step-00000004"
        delete_files(st, newest, [n for n in st.list_dir(newest) if n.startswith("data-00001-")])
    dist.barrier()
    model, opt = build("ddp", seed=123)
    state = {"model": model, "optimizer": opt, "step": 0}
    with CheckpointManager(root, every_n_steps=1, keep_last=2, save_on_signals=(), timeout=60) as mgr:
        out["resumed"] = mgr.resume(state)
    out["state"] = full_state(model, opt)
    return out


def _objects(server: S3Server, url: str) -> list[str]:
    return FsspecStorage.for_path(url, server.storage_options).list_dir(url)


def _no_uploads_left(server: S3Server, bucket: str) -> bool:
    st = FsspecStorage.for_path(f"s3://{bucket}", server.storage_options)
    return list_uploads(st.fs, f"{bucket}/", RetryPolicy()) == []


@needs_fsdp2_on_cpu
def test_round_trip_and_resharding_load(s3_server: S3Server, s3_bucket: str) -> None:
    """FSDP2-sharded parameters and optimizer state plus replicated tensors, 2 ranks -> 2 ranks -> 1."""
    url, opts = f"s3://{s3_bucket}/run/step-2", s3_server.storage_options
    results = check_ok(run_ranks(_save_then_load, 2, url, opts, "fsdp", env=ENV, timeout=180))
    for saved, loaded in results:
        assert_same(saved, loaded)
    info = shardsafe.inspect(url, storage_options=opts)
    assert info.world_size == 2 and len(info.files) == 2  # each rank wrote one data file
    assert shardsafe.verify(url, storage_options=opts).files == 2
    assert _objects(s3_server, url) == sorted([MANIFEST_NAME, *info.files])
    # resharded: the 2-rank checkpoint into one plain process
    model, opt = build("plain", seed=5)
    state = _state(model, opt, 999)
    shardsafe.load(url, state, storage_options=opts)
    assert_same(results[0][0], {**full_state(model, opt), **{f"extra/{k}": v for k, v in state["extra"].items()}})


def test_overwrite_replaces_and_removes_old_objects(s3_server: S3Server, s3_bucket: str) -> None:
    url, opts = f"s3://{s3_bucket}/run/latest", s3_server.storage_options
    (refused, second, loaded), _ = check_ok(run_ranks(_save_overwrite_load, 2, url, opts, env=ENV, timeout=180))
    assert "overwrite=True" in refused
    assert_same(second, loaded)
    info = shardsafe.inspect(url, storage_options=opts)
    assert _objects(s3_server, url) == sorted([MANIFEST_NAME, *info.files])  # old data objects removed


def test_rank_killed_mid_upload_keeps_the_previous_checkpoint(s3_server: S3Server, s3_bucket: str) -> None:
    url, opts = f"s3://{s3_bucket}/run/latest", s3_server.storage_options
    first = _save(url, opts, "plain", 0, overwrite=False)  # the previous checkpoint, from one process
    before = shardsafe.inspect(url, storage_options=opts)
    fault = {1: {"SHARDSAFE_FAULT": "save.write:rank=1:exit"}}
    out = run_ranks(_overwrite_save, 2, url, opts, env=ENV, rank_env=fault, timeout=120)
    assert out[1].exitcode == 13 and not out[0].ok and not out[0].killed  # rank 0 failed cleanly, no hang
    assert "rank 1" in (out[0].error or "") or "[1]" in (out[0].error or ""), out[0].error
    assert shardsafe.inspect(url, storage_options=opts).save_id == before.save_id
    shardsafe.verify(url, storage_options=opts)
    assert_same(first, _load(url, opts, "plain"))
    # rank 0 removed what the failed save wrote and aborted rank 1's unfinished multipart upload
    assert _objects(s3_server, url) == sorted([MANIFEST_NAME, *before.files])
    assert _no_uploads_left(s3_server, s3_bucket)


@needs_fsdp2_on_cpu
def test_transient_faults_on_every_rank_are_retried(s3_server: S3Server, s3_bucket: str) -> None:
    url, opts = f"flakys3://{s3_bucket}/run/step-2", s3_server.storage_options
    plan = {
        "create_multipart_upload": ["lost"],
        "upload_part": ["slowdown", "lost", "reset"],
        "complete_multipart_upload": ["lost"],
        "put_object": ["reset"],
        "head_object": ["slowdown"],
        "get_object": ["reset", "slowdown", "lost"],
    }
    env = {**ENV, FAULTS_ENV: json.dumps(plan), "SHARDSAFE_REMOTE_RETRY_SECONDS": "30"}
    for saved, loaded in check_ok(run_ranks(_save_then_load, 2, url, opts, "fsdp", env=env, timeout=180)):
        assert_same(saved, loaded)
    assert shardsafe.verify(f"s3://{s3_bucket}/run/step-2", storage_options=opts).files == 2
    assert _no_uploads_left(s3_server, s3_bucket)


def test_manager_retention_and_resume_on_an_s3_root(s3_server: S3Server, s3_bucket: str) -> None:
    root = f"s3://{s3_bucket}/run"
    env = {  # the manager takes the endpoint and credentials from the usual AWS environment
        "AWS_ENDPOINT_URL": s3_server.endpoint_url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    results = check_ok(run_ranks(_manager_run, 2, root, env=env, timeout=240))
    for r in results:
        assert r["kept"] == ["step-00000003", "step-00000004"]  # retention deleted steps 1 and 2
        assert r["resumed"] == 3  # step 4 lost a data object: skipped, the newest intact one loads
        assert_same(r["at3"], r["state"])
    listed = FsspecStorage.for_path(root, s3_server.storage_options).list_dir(root)
    assert listed == ["step-00000003", "step-00000004"]  # the damaged one is kept for inspection


def test_cli_on_s3_urls(s3_server: S3Server, s3_bucket: str, monkeypatch: Any, capsys: Any) -> None:
    from shardsafe.cli import main

    for name, value in {
        "AWS_ENDPOINT_URL": s3_server.endpoint_url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    root = f"s3://{s3_bucket}/run"
    url = f"{root}/step-00000001"
    shardsafe.save(url, {"w": torch.arange(1000.0), "step": 1}, storage_options=s3_server.storage_options)
    assert main(["inspect", url]) == 0 and "w" in capsys.readouterr().out
    assert main(["verify", url]) == 0 and capsys.readouterr().out.startswith(f"OK {url}")
    assert main(["ls", root]) == 0 and "step-00000001" in capsys.readouterr().out
    st = FsspecStorage.for_path(url, s3_server.storage_options)
    (data,) = shardsafe.inspect(url, storage_options=s3_server.storage_options).files
    flipped = bytearray(st.read_bytes(f"{url}/{data}"))
    flipped[-1] ^= 0xFF
    st.fs.pipe_file(st._p(f"{url}/{data}"), bytes(flipped))
    assert main(["verify", url]) == 1 and "CORRUPT" in capsys.readouterr().err
    assert main(["inspect", f"{root}/step-00000009"]) == 1 and "NOT A CHECKPOINT" in capsys.readouterr().err


def test_incremental_save_refers_deletes_and_exports_on_s3(s3_server: S3Server, s3_bucket: str) -> None:
    """save(base=) on S3: unchanged chunks refer to the base's objects; a deleted base is retired with
    its referenced objects kept; a self-contained export loads after the base is gone entirely."""
    from shardsafe.catalog.delete import delete_checkpoint
    from shardsafe.interop.consolidate import consolidate

    opts = s3_server.storage_options
    root = f"s3://{s3_bucket}/run"
    state = {"frozen": torch.arange(4096.0).reshape(64, 64), "train": torch.zeros(64, 64), "step": 1}
    shardsafe.save(f"{root}/s1", state, storage_options=opts)
    state["train"] += 1
    shardsafe.save(f"{root}/s2", state, base=f"{root}/s1", storage_options=opts)
    assert shardsafe.inspect(f"{root}/s2", storage_options=opts).bases == ["s1"]
    st = FsspecStorage.for_path(root, opts)
    delete_checkpoint(st, f"{root}/s1")
    out = shardsafe.load(f"{root}/s2", storage_options=opts)
    assert torch.equal(out["frozen"], state["frozen"]) and torch.equal(out["train"], state["train"])
    shardsafe.verify(f"{root}/s2", storage_options=opts)
    consolidate(f"{root}/s2", f"{root}/copy", storage_options=opts)
    delete_checkpoint(st, f"{root}/s2")
    assert sorted(st.list_dir(root)) == ["copy"]  # the retired base went with its last referrer
    out = shardsafe.load(f"{root}/copy", storage_options=opts)
    assert torch.equal(out["frozen"], state["frozen"]) and torch.equal(out["train"], state["train"])


def test_overwritten_base_objects_go_with_their_last_referrer_on_s3(s3_server: S3Server, s3_bucket: str) -> None:
    """An overwrite of s1 keeps the objects s2 refers to; deleting s2 removes them (nothing else)."""
    from shardsafe.catalog.delete import delete_checkpoint

    opts = s3_server.storage_options
    root = f"s3://{s3_bucket}/run"
    state = {"frozen": torch.arange(4096.0).reshape(64, 64), "train": torch.zeros(64, 64), "step": 1}
    shardsafe.save(f"{root}/s1", state, storage_options=opts)
    st = FsspecStorage.for_path(root, opts)
    old = st.list_dir(f"{root}/s1")
    state["train"] += 1
    shardsafe.save(f"{root}/s2", state, base=f"{root}/s1", storage_options=opts)
    other = {"w": torch.ones(8), "step": 7}
    shardsafe.save(f"{root}/s1", other, overwrite=True, storage_options=opts)
    assert set(old) < set(st.list_dir(f"{root}/s1"))  # kept for s2
    delete_checkpoint(st, f"{root}/s2")
    assert st.list_dir(root) == ["s1"]
    left = st.list_dir(f"{root}/s1")
    assert MANIFEST_NAME in left and not set(left) & (set(old) - {MANIFEST_NAME})
    out = shardsafe.load(f"{root}/s1", storage_options=opts)
    assert torch.equal(out["w"], other["w"]) and out["step"] == 7
    shardsafe.verify(f"{root}/s1", storage_options=opts)
