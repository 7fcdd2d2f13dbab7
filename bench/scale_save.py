"""The save side of bench/scale_sim.py: every simulated rank's real save planning and write report,
rank 0's real commit step, and the real commit protocol on a real ``TCPStore``.

- :func:`save_ranks` (every rank): ``engine/plan.py:plan_save`` on the rank's state
  (bench/scale_layouts.py), then its data file as ``format/datafile.py:write_file`` lays it out (the
  real header of ``build_header`` and an index of the real length, written around a sparse hole of
  the data's size: the bytes are not written nor hashed, so the index's checksums are zeros), then
  its ``WriteReport`` and the envelope it sends, as ``engine/save.py`` builds them.
- :func:`commit_step` (rank 0, in a process of its own): from the ``written`` round's messages as the
  store hands them (one string), what ``engine/commit.py`` does before the decision: parse the
  envelopes and reports, ``build_manifest``, ``Manifest.to_bytes``, ``parse_manifest``; then the
  staging and publish of ``storage/local.py`` (not timed).
- :func:`protocol` (every rank, a thread each, its own store connection): the save's two agreements
  with the real ``Operation``, ``agree`` and ``engine/commit.py:Committer.run`` (rank 0 builds,
  stages, decides, publishes, waits for every acknowledgement): the store requests each rank makes.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import xxhash

from bench.scale_layouts import MODELS, Layout
from shardsafe.coord.messages import Envelope
from shardsafe.engine.messages import CHANNEL, SAVE_ARRIVE, SaveArrival, SaveStart, WriteReport
from shardsafe.engine.plan import SavePlan, plan_save
from shardsafe.engine.save import _fingerprint
from shardsafe.format.datafile import build_header
from shardsafe.format.index import blocks, encode_index, index_bytes
from shardsafe.format.manifest import Chunk, FileEntry
from shardsafe.format.names import data_file
from shardsafe.state import per_rank

BLOCK = 8 << 20


def fake_write(directory: Path, plan: SavePlan, save_id: str, block: int) -> tuple[FileEntry, list[Chunk]] | None:
    """The data file ``write_file`` would write for ``plan`` (its header and index, around a sparse hole
    where the chunks' bytes go), and the chunk records it would return (zero checksums)."""
    chunks = plan.chunks
    if not chunks:
        return None
    name = data_file(plan.rank, save_id)
    header = build_header(chunks, plan.ruled, block)
    sums = [["0" * 16] * blocks(c.nbytes, block) for c in chunks]
    ruled = len(chunks) - plan.ruled
    index = encode_index(sums[ruled:]) if plan.ruled else b""
    assert len(index) == (index_bytes([c.nbytes for c in chunks[ruled:]], block) if plan.ruled else 0)
    data = sum(c.nbytes for c in chunks)
    with open(directory / name, "wb") as f:
        f.write(header)
        f.seek(len(header) + data)
        f.write(index)
        f.truncate(len(header) + data + len(index))
    records, pos = [], len(header)
    for c, s in zip(chunks, sums, strict=True):
        records.append(Chunk(c.offsets, c.sizes, name, c.key, pos, pos + c.nbytes, tuple(s), "0" * 32))
        pos += c.nbytes
    entry = FileEntry(
        len(header) + data + len(index),
        len(header),
        xxhash.xxh3_64_hexdigest(header),
        xxhash.xxh3_64_hexdigest(index) if plan.ruled else None,
    )
    return entry, records


def _save_stripe(args: tuple[str, str, int, list[int], str, str, int]) -> list[tuple[int, str, float, int]]:
    model, strategy, world, ranks, pending, save_id, block = args
    layout = Layout(MODELS[model], strategy, world)
    out = []
    for rank in ranks:
        flat = layout.flat(rank)
        gc.disable()
        started = time.process_time()
        plan = plan_save(flat, rank, world)
        planned = time.process_time() - started  # CPU seconds: ranks share 2 cores with other jobs
        gc.enable()
        written = fake_write(Path(pending), plan, save_id, block)
        files, chunks = {}, []
        if written is not None:
            entry, records = written
            files[entry_name(rank, save_id)] = [
                entry.size,
                entry.header_bytes,
                entry.header_checksum,
                entry.index_checksum,
            ]
            chunks = [[c.name, r.to_json()] for c, r in zip(plan.chunks, records, strict=True) if plan.listed(c.name)]
        report = WriteReport(chunks, files, _fingerprint(flat, plan.rules), block, per_rank.report(flat), [0, 0])
        text = Envelope(rank, report.to_json()).to_text()
        out.append((rank, text, planned, len(plan.chunks)))
    return out


def entry_name(rank: int, save_id: str) -> str:
    return data_file(rank, save_id)


def save_ranks(model: str, strategy: str, world: int, pending: Path, save_id: str, workers: int = 2) -> dict[str, Any]:
    """Every rank's save planning, data file and report; the reports in rank order."""
    stripes = [
        (model, strategy, world, list(range(w, world, workers)), str(pending), save_id, BLOCK) for w in range(workers)
    ]
    ctx = mp.get_context("fork")
    started = time.monotonic()
    with ctx.Pool(workers) as pool:
        parts = pool.map(_save_stripe, stripes)
    rows = sorted(r for part in parts for r in part)
    texts = [t for _, t, _, _ in rows]
    plan_seconds = [s for _, _, s, _ in rows]
    sizes = [len(t) for t in texts]
    return {
        "texts": texts,
        "wall_seconds": time.monotonic() - started,
        "plan_seconds_median": statistics.median(plan_seconds),
        "plan_seconds_max": max(plan_seconds),
        "report_bytes_max": max(sizes),
        "report_bytes_median": statistics.median(sizes),
        "report_bytes_total": sum(sizes),
        "files": sum(1 for _, t, _, c in rows if c),
    }


def commit_inputs(layout: Layout, target: str, pending: str, save_id: str) -> Any:
    from shardsafe.engine.commit import CommitInputs
    from shardsafe.storage.local import LocalStorage

    flat = layout.flat(0)
    return CommitInputs(
        path=target,
        storage=LocalStorage(),
        save_id=save_id,
        pending=pending,
        overwrite=False,
        block_bytes=BLOCK,
        flat=flat,
        metadata=None,
        base_manifest=None,
        base_name="",
        started=time.monotonic(),
        blocking_seconds=0.0,
        rules=plan_save(flat, 0, layout.world).rules,
    )


def commit_step(
    model: str, strategy: str, world: int, messages: str, target: str, pending: str, save_id: str, publish: bool
) -> dict[str, Any]:
    """(rank 0, a fresh process) The commit step timed part by part, its peak memory; then, with
    ``publish``, the staging and publish (the protocol run publishes otherwise)."""
    from bench.scale_rank import rss
    from shardsafe.catalog.names import commit_of
    from shardsafe.engine.commit import build_manifest
    from shardsafe.format.manifest import parse_manifest

    layout = Layout(MODELS[model], strategy, world)
    inputs = commit_inputs(layout, target, pending, save_id)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before, _ = rss()
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    envelopes = {}
    for line in messages.splitlines():
        if line:
            env = Envelope.from_text(line)
            envelopes.setdefault(env.rank, env)
    reports = {rank: WriteReport.from_json(e.body) for rank, e in envelopes.items()}
    t1 = time.perf_counter()
    manifest = build_manifest(inputs, world, reports)
    t2 = time.perf_counter()
    raw = manifest.to_bytes()
    t3 = time.perf_counter()
    parse_manifest(raw, f"{target}/MANIFEST.json")
    t4 = time.perf_counter()
    cpu = time.process_time() - cpu0
    growth = rss()[1] - before
    if publish:
        commit = commit_of(pending, target, save_id, raw, manifest.files)
        inputs.storage.stage_manifest(commit)
        inputs.storage.publish(commit, overwrite=False, at_commit=lambda: None)
    return {
        "seconds": t4 - t0,
        "cpu_seconds": cpu,
        "read_reports_seconds": t1 - t0,
        "build_seconds": t2 - t1,
        "bytes_seconds": t3 - t2,
        "validate_seconds": t4 - t3,
        "rss_growth": growth,
        "manifest_bytes": len(raw),
        "tensors": len(manifest.tensors),
        "listed_chunks": sum(len(t.chunks) for t in manifest.tensors.values()),
        "files": len(manifest.files),
    }


STORE_HOST = """
import sys, time
from datetime import timedelta
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=3600))
print(store.port, flush=True)
sys.stdin.read()  # until the parent closes it
"""


def protocol(
    model: str,
    strategy: str,
    world: int,
    texts: list[str],
    target: str,
    pending: str,
    save_id: str,
    processes: int = 16,
) -> dict[str, Any]:
    """The save's two agreements with the real ``Operation``, ``agree`` and
    ``engine/commit.py:Committer.run`` (rank 0 builds, stages, decides, publishes, waits for every
    acknowledgement), a thread per rank with its own store connection, the ranks spread over
    ``processes`` processes, the ``TCPStore`` hosted by a process of its own (as under torchrun):
    each rank's store requests and the round's wall time."""
    import subprocess
    import sys

    host = subprocess.Popen(
        [sys.executable, "-c", STORE_HOST], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert host.stdout is not None
        port = int(host.stdout.readline())
        ctx = mp.get_context("fork")
        queue = ctx.Queue()
        started = time.monotonic()
        workers = [
            ctx.Process(
                target=_protocol_ranks,
                args=(
                    model,
                    strategy,
                    world,
                    list(range(p, world, processes)),
                    texts,
                    target,
                    pending,
                    save_id,
                    port,
                    queue,
                ),
            )
            for p in range(processes)
        ]
        for w in workers:
            w.start()
        results: dict[int, Any] = {}
        errors: list[str] = []
        for _ in workers:
            part, errs = queue.get(timeout=3600)
            results.update(part)
            errors += errs
        for w in workers:
            w.join(60)
        took = time.monotonic() - started
    finally:
        host.kill()
        host.wait()
    if errors:
        raise RuntimeError("; ".join(errors[:5]))
    others = [results[r][0] for r in results if r]
    return {
        "wall_seconds": took,
        "processes": processes,
        "rank0_waited": results[0][0],
        "rank0_posted": results[0][1],
        "others_waited_max": max(others),
        "others_waited_min": min(others),
        "others_posted_max": max(results[r][1] for r in results if r),
        "rank0_kinds": results[0][2],
        "others_kinds": results[max(results)][2],
    }


def _protocol_ranks(
    model: str,
    strategy: str,
    world: int,
    ranks: list[int],
    texts: list[str],
    target: str,
    pending: str,
    save_id: str,
    port: int,
    queue: Any,
) -> None:
    """(one process of :func:`protocol`) A thread per rank of ``ranks``; puts (tallies, errors)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from shardsafe.coord.operation import Operation
    from shardsafe.deadline import Deadlines
    from shardsafe.engine.commit import Committer
    from shardsafe.progress.tracker import Tracker

    layout = Layout(MODELS[model], strategy, world)
    inputs = commit_inputs(layout, target, pending, save_id) if 0 in ranks else None
    threading.stack_size(1 << 20)
    tallies: dict[int, Any] = {}
    errors: list[str] = []
    budget = Deadlines(arrive=1800, io=1800)

    def rank_main(rank: int) -> None:
        try:
            store = TCPStore(
                "127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=1800)
            )
            op = Operation.begin(
                "save", target, budget.start(), channel=CHANNEL, store=store, rank=rank, world_size=world
            )
            try:
                start = SaveStart(save_id, pending, BLOCK, None, [], [], [""] * world)
                op.agree(SAVE_ARRIVE, SaveArrival({}, {}, ""), lambda _e: start)
                report = WriteReport.from_json(Envelope.from_text(texts[rank]).body)
                mine = inputs if inputs is not None and rank == 0 else _follower_inputs(target, pending, save_id)
                tracker = Tracker("save", target, None)
                tracker.start(op, lambda: "commit")
                try:
                    Committer(op, mine, tracker, lambda _p: None).run(report, None)
                finally:
                    tracker.end(None)
            finally:
                op.close()
                tallies[rank] = op.session.tally
        except BaseException as err:  # reported by the parent
            errors.append(f"rank {rank}: {type(err).__name__}: {err}"[:2000])

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3000)
    out = {r: (sum(t.waited.values()), sum(t.posted.values()), dict(t.waited)) for r, t in tallies.items()}
    queue.put((out, errors))


def _follower_inputs(target: str, pending: str, save_id: str) -> Any:
    """What a rank other than 0 needs of the save's inputs (its path, save id, pending directory)."""
    from shardsafe.engine.commit import CommitInputs
    from shardsafe.state.flatten import FlatState
    from shardsafe.storage.local import LocalStorage

    return CommitInputs(
        path=target,
        storage=LocalStorage(),
        save_id=save_id,
        pending=pending,
        overwrite=False,
        block_bytes=BLOCK,
        flat=FlatState(objects={}, items=[], strategy="fsdp"),
        metadata=None,
        base_manifest=None,
        base_name="",
        started=time.monotonic(),
        blocking_seconds=0.0,
    )
