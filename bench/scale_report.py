"""Tables and chart of bench/scale_sim.py's results (``scale.json``): what every rank reads, each rank's
load planning, rank 0's commit step, the write reports and store requests, DCP beside each.

DCP figures that were not measured (its metadata too large for the machine) are extrapolated in the
number of chunks (tensors x ranks, here the world, the tensors being fixed): linearly from the two
largest worlds measured for the same model and strategy, or in proportion from the one measured, and
printed in italics with a trailing ``*``."""

from __future__ import annotations

from typing import Any

MiB = 2**20


def _cells(results: dict[str, Any]) -> list[dict[str, Any]]:
    order = {"7B": 0, "70B": 1, "405B": 2}
    strat = {"fsdp2": 0, "hsdp": 1, "fsdp_tp": 2}
    return sorted(results["cells"], key=lambda c: (order[c["model"]], strat[c["strategy"]], c["world"]))


def _secs(d: dict[str, Any], wall: str = "seconds", cpu: str = "cpu_seconds") -> float:
    """CPU seconds where measured (what the work costs, whatever shares the machine), else wall."""
    return float(d[cpu] if cpu in d else d[wall])


def _worst(cell: dict[str, Any], who: str, key: str) -> float | None:
    values = [(_secs(r[who]) if key == "seconds" else r[who][key]) for r in cell["load"].values() if r.get(who)]
    return max(values) if values else None


def dcp_figures(results: dict[str, Any], cell: dict[str, Any]) -> tuple[dict[str, float], bool]:
    """DCP's metadata bytes, coordinator seconds, per-rank load planning seconds and memory for
    ``cell``: measured, or extrapolated (second value True) from the same model and strategy."""
    if cell.get("dcp") and _worst(cell, "dcp", "seconds") is not None:
        return {
            "metadata_bytes": cell["dcp"]["metadata_bytes"],
            "global_seconds": _secs(cell["dcp"]) + _secs(cell["dcp"], "pickle_seconds", "pickle_cpu_seconds"),
            "load_seconds": _worst(cell, "dcp", "seconds") or 0.0,
            "load_rss": _worst(cell, "dcp", "rss_growth") or 0.0,
        }, False
    peers = [
        c
        for c in results["cells"]
        if (c["model"], c["strategy"]) == (cell["model"], cell["strategy"])
        and c.get("dcp")
        and _worst(c, "dcp", "seconds")
    ]
    peers.sort(key=lambda c: c["world"])
    if not peers:
        return {}, True
    x = cell["world"]
    fb = dcp_figures(results, peers[-1])[0]
    if len(peers) < 2:  # proportional to the chunks, from the one world measured
        return {k: v * x / peers[-1]["world"] for k, v in fb.items()}, True
    a, b = peers[-2], peers[-1]
    fa = dcp_figures(results, a)[0]
    out = {}
    for k in fa:
        slope = (fb[k] - fa[k]) / (b["world"] - a["world"])
        out[k] = fb[k] + slope * (x - b["world"])
    return out, True


def _fmt(x: float | None, spec: str, extrapolated: bool = False) -> str:
    if x is None:
        return "-"
    text = format(x, spec)
    return f"*{text}\\**" if extrapolated else text


def markdown(results: dict[str, Any]) -> str:
    m = results.get("machine", {})
    lines = [
        f"# Metadata and coordination at scale ({m.get('when', '?')}, {m.get('cpus', '?')} cores, "
        f"torch {m.get('torch', '?')})",
        "",
        "Simulated ranks run shardsafe's real save planning, write reports, commit step, commit protocol",
        "and load planning (`bench/scale_sim.py`; the method and what is simulated are in its docstring and",
        "in `bench/README.md`). Llama-style models with AdamW, float32; FSDP2 on one mesh of N ranks, HSDP",
        "with shard groups of 64, FSDP x TP with tp = 8. *Italics\\** are DCP figures extrapolated in chunks",
        "(tensors x ranks) from the largest worlds measured: its metadata did not fit this machine.",
        "",
        "## What every rank reads, and how long its load planning takes",
        "",
        "Metadata a rank reads to plan its load: shardsafe the manifest plus the header and index of each",
        "data file its shards meet (the worst of ranks 0, N/2+1, N-1); DCP the `.metadata` file, pickled.",
        "Planning: shardsafe's `plan_load` (manifest read and validated, indexes read, reads planned) and",
        "DCP's (`.metadata` read and unpickled, `set_up_planner`, `create_local_plan`): median CPU seconds",
        "of the process (the machine is shared with other jobs: wall times, in scale.json, vary with them)",
        "and peak resident growth of the first run, the worst of the sampled ranks.",
        "",
        "| model | strategy | ranks | tensors | shardsafe metadata read (MiB) | manifest (MiB) | DCP .metadata (MiB) "
        "| shardsafe planning (s) | DCP planning (s) | ratio | shardsafe planning memory (MiB) | DCP (MiB) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in _cells(results):
        dcp, ex = dcp_figures(results, c)
        mine_s = _worst(c, "shardsafe", "seconds")
        ratio = mine_s / dcp["load_seconds"] if dcp.get("load_seconds") and mine_s else None
        lines.append(
            f"| {c['model']} | {c['strategy']} | {c['world']} | {c['tensors']} "
            f"| {_fmt((_worst(c, 'shardsafe', 'metadata_bytes') or 0) / MiB, '.2f')} "
            f"| {_fmt(c['commit']['manifest_bytes'] / MiB, '.2f')} "
            f"| {_fmt(dcp.get('metadata_bytes', 0) / MiB if dcp else None, '.1f', ex)} "
            f"| {_fmt(mine_s, '.3f')} | {_fmt(dcp.get('load_seconds'), '.2f', ex)} | {_fmt(ratio, '.3f', ex)}x "
            f"| {_fmt((_worst(c, 'shardsafe', 'rss_growth') or 0) / MiB, '.0f')} "
            f"| {_fmt(dcp.get('load_rss', 0) / MiB if dcp else None, '.0f', ex)} |"
        )
    lines += [
        "",
        "## Rank 0's commit step, the write reports and the store",
        "",
        "Rank 0's commit step: the `written` round's messages read (one string from the store), parsed,",
        "`build_manifest`, `to_bytes`, `parse_manifest` (what it does before the decision), CPU seconds and",
        "peak resident growth; DCP's coordinator: `create_global_plan` and the pickling of `.metadata`.",
        "Write report: the envelope each rank sends in `written` (largest, median). Store requests: waited",
        "(posted) per rank, from the commit protocol run with a thread per rank on one `TCPStore`.",
        "",
        "| model | strategy | ranks | commit step (s) | of which reading reports (s) | memory (MiB) "
        "| DCP global plan (s) | report max (B) | report median (B) | save planning per rank (s, median) "
        "| store: rank 0 | store: others |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in _cells(results):
        dcp, ex = dcp_figures(results, c)
        p = c.get("protocol")
        store0 = f"{p['rank0_waited']} ({p['rank0_posted']})" if p else "-"
        others = f"{p['others_waited_max']} ({p['others_posted_max']})" if p else "-"
        lines.append(
            f"| {c['model']} | {c['strategy']} | {c['world']} | {_secs(c['commit']):.3f} "
            f"| {c['commit']['read_reports_seconds']:.3f} | {c['commit']['rss_growth'] / MiB:.0f} "
            f"| {_fmt(dcp.get('global_seconds'), '.2f', ex)} | {c['save']['report_bytes_max']} "
            f"| {c['save']['report_bytes_median']:.0f} | {c['save']['plan_seconds_median']:.3f} | {store0} | {others} |"
        )
    lines += _targets(results)
    lines += _real(results.get("real"))
    return "\n".join(lines) + "\n"


def _targets(results: dict[str, Any]) -> list[str]:
    """The targets of the scale work, per model under FSDP2 at its largest world (and the same at
    the others): metadata read, planning time and memory, commit step, store requests, ratio to DCP."""
    lines = ["", "## Targets (FSDP2, AdamW)", ""]
    lines.append(
        "| model | ranks | metadata read <= 16 MiB | planning <= 1 s | planning memory <= 256 MiB | "
        "commit step <= 2 s | store requests as at 16 ranks | planning <= 0.5x DCP |"
    )
    lines.append("|---|---:|---|---|---|---|---|---|")
    ref = next(
        (c["protocol"] for c in _cells(results) if c["world"] == 16 and c.get("protocol")),
        {"rank0_waited": 8, "others_waited_max": 5},  # tests/test_core.py and bench/protocol.py at 16 ranks
    )

    def mark(ok: bool | None, text: str) -> str:
        return f"{text} {'**met**' if ok else '**missed**' if ok is not None else '(not measured)'}"

    for c in _cells(results):
        if c["strategy"] != "fsdp2" or c["world"] < 256:
            continue
        dcp, ex = dcp_figures(results, c)
        read = (_worst(c, "shardsafe", "metadata_bytes") or 0) / MiB
        secs = _worst(c, "shardsafe", "seconds") or 0.0
        mem = (_worst(c, "shardsafe", "rss_growth") or 0) / MiB
        commit = _secs(c["commit"])
        p = c.get("protocol")
        same = (
            None
            if not p
            else (p["rank0_waited"], p["others_waited_max"]) == (ref["rank0_waited"], ref["others_waited_max"])
        )
        store = f"{p['rank0_waited']} / {p['others_waited_max']}" if p else "-"
        ratio = secs / dcp["load_seconds"] if dcp.get("load_seconds") else None
        cols = [
            mark(read <= 16, f"{read:.2f} MiB"),
            mark(secs <= 1, f"{secs:.2f} s"),
            mark(mem <= 256, f"{mem:.0f} MiB"),
            mark(commit <= 2, f"{commit:.2f} s"),
            mark(same, store),
            mark(None if ratio is None else ratio <= 0.5, _fmt(ratio, ".3f", ex) + "x"),
        ]
        lines.append(f"| {c['model']} | {c['world']} | " + " | ".join(cols) + " |")
    return lines


def _real(real: dict[str, Any] | None) -> list[str]:
    """bench/scale_real.py's figures, when present."""
    if not real:
        return []
    lines = [
        "",
        "## A real FSDP2 save of 720 tensors (bench/scale_real.py)",
        "",
        "Metadata written (bytes): the manifest, the headers and the indexes of every data file, against",
        "DCP's `.metadata` for the same state saved in the same session.",
        "",
        "| ranks | manifest | headers | indexes | total | DCP .metadata | ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for world, r in sorted(real["worlds"].items(), key=lambda kv: int(kv[0])):
        m = r["shardsafe"]
        lines.append(
            f"| {world} | {m['manifest']} | {m['headers']} | {m['indexes']} | {m['total']} | {r['dcp_metadata']} "
            f"| {r['ratio_to_dcp']:.2f}x |"
        )
    lines += [
        "",
        f"Growth of shardsafe's metadata from the fewest to the most ranks: {real['growth']:.2f}x. The checkpoint of "
        f"the most ranks loads into one plain process equal: {real['one_process_equal']}; into 3 FSDP2 ranks equal: "
        f"{real['three_ranks_equal']}.",
    ]
    return lines


def chart(results: dict[str, Any], path: str) -> None:
    """Time and memory against ranks: per-rank load planning and rank 0's commit (shardsafe, DCP), and
    the metadata a rank reads."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    colors = {"7B": "tab:green", "70B": "tab:blue", "405B": "tab:red"}
    for model, strategy in sorted({(c["model"], c["strategy"]) for c in results["cells"]}):
        if strategy != "fsdp2":
            continue
        cells = sorted(
            (c for c in results["cells"] if (c["model"], c["strategy"]) == (model, strategy)), key=lambda c: c["world"]
        )
        x = [c["world"] for c in cells]
        dcp = [dcp_figures(results, c) for c in cells]
        color = colors.get(model, "black")
        axes[0].plot(
            x, [_worst(c, "shardsafe", "seconds") for c in cells], "o-", color=color, label=f"{model} shardsafe"
        )
        axes[0].plot(x, [d[0].get("load_seconds") for d in dcp], "s--", color=color, alpha=0.6, label=f"{model} DCP")
        axes[1].plot(
            x,
            [(_worst(c, "shardsafe", "rss_growth") or 0) / MiB for c in cells],
            "o-",
            color=color,
            label=f"{model} shardsafe",
        )
        axes[1].plot(
            x, [d[0].get("load_rss", 0) / MiB for d in dcp], "s--", color=color, alpha=0.6, label=f"{model} DCP"
        )
        axes[2].plot(
            x,
            [(_worst(c, "shardsafe", "metadata_bytes") or 0) / MiB for c in cells],
            "o-",
            color=color,
            label=f"{model} shardsafe",
        )
        axes[2].plot(
            x, [d[0].get("metadata_bytes", 0) / MiB for d in dcp], "s--", color=color, alpha=0.6, label=f"{model} DCP"
        )
        axes[0].plot(x, [_secs(c["commit"]) for c in cells], "^:", color=color, label=f"{model} rank 0 commit step")
    titles = [
        "load planning per rank (s)",
        "load planning memory per rank (MiB, peak growth)",
        "metadata a rank reads (MiB)",
    ]
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks (FSDP2, AdamW)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("shardsafe format v3 vs DCP at scale (dashed: DCP; extrapolated where its metadata did not fit)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
