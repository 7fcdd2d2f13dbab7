"""Train a small transformer language model on generated data with shardsafe: 2 processes, FSDP2 on CPU,
a checkpoint every N steps, a crash, a resume, and a bit-for-bit check against an uninterrupted run.

    python examples/train.py                        # the whole show (what `make run` runs):
                                                    #   train with a crash, resume, train a reference
                                                    #   run without a crash, compare them bit for bit
    python examples/train.py train --crash-at-step 37   # one run; a rank is killed at step 37
    python examples/train.py train                  # the next invocation resumes from the last checkpoint
    python examples/train.py compare DIR_A DIR_B    # compare the final states of two runs

Every run is deterministic: the model is seeded, the data of step s is generated from (seed, s) alone,
and torch runs its deterministic kernels, so a resumed run must end with exactly the bits of a run
that never stopped. `demo` exits 1 if they differ.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import shardsafe
from shardsafe.manager import CheckpointManager
from shardsafe.runtime import Runtime, WorkerError

DEMO_MARKER = ".shardsafe-example"
CRASH_EXIT = 3  # `train --crash-at-step` exits with this once the crash happened as asked


# ------------------------------------------------------------------------------------------------ model


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class TinyLM(nn.Module):
    """A GPT-style language model; its blocks live in an nn.ModuleList, which is what the runtime's
    default FSDP policy shards one by one."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


# ------------------------------------------------------------------------------------------------- data


class Language:
    """A random sparse Markov chain over the vocabulary: each token has 4 likely successors. The model
    can learn it (the loss falls from ln(vocab) towards the chain's entropy)."""

    def __init__(self, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(vocab, (vocab, 4), generator=g)
        self.probs = torch.softmax(torch.randn(vocab, 4, generator=g) * 1.5, dim=1)
        self.vocab = vocab

    def batch(self, seed: int, step: int, rows: int, seq: int) -> torch.Tensor:
        """The global batch of ``step``: the same on every rank and in every run."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        out = torch.empty(rows, seq + 1, dtype=torch.long)
        out[:, 0] = torch.randint(self.vocab, (rows,), generator=g)
        for t in range(seq):
            pick = torch.multinomial(self.probs[out[:, t]], 1, generator=g).squeeze(1)
            out[:, t + 1] = self.successors[out[:, t], pick]
        return out


def learning_rate(step: int, total: int, peak: float) -> float:
    """Warm-up then cosine: a pure function of the step, so nothing about it needs saving."""
    warm = max(1, total // 10)
    if step <= warm:
        return peak * step / warm
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))


# --------------------------------------------------------------------------------------------- training


def train(rt: Runtime, args: argparse.Namespace) -> dict[str, Any]:
    """(every rank) Resume from the newest checkpoint under ``args.dir`` if any, train to ``args.steps``,
    save the final state to ``<dir>/final``."""
    torch.use_deterministic_algorithms(True)
    rt.seed_everything(args.seed)
    model = TinyLM(args.vocab, args.dim, args.layers, args.heads, args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    model, opt = rt.setup(model, opt)
    lang = Language(args.vocab, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    rt.print(f"model: {args.layers} blocks, dim {args.dim}, {_millions(n_params)} parameters; {rt!r}")

    state: dict[str, Any] = {"model": model, "optim": opt, "step": 0}
    mgr = CheckpointManager(args.dir, every_n_steps=args.every, keep_last=args.keep_last, timeout=args.timeout)
    try:
        resumed = mgr.resume(state)
        start = resumed or 0
        if resumed is None:
            rt.print(f"no checkpoint under {args.dir}: starting at step 0")
        else:
            rt.print(f"resumed from the checkpoint of step {resumed} under {args.dir}")
        loss_sum, since, t0 = torch.zeros(()), 0, time.perf_counter()
        for step in range(start + 1, args.steps + 1):
            for group in opt.param_groups:
                group["lr"] = learning_rate(step, args.steps, args.lr)
            tokens = lang.batch(args.seed, step, args.batch * rt.world_size, args.seq)[rt.rank :: rt.world_size]
            tokens = rt.to_device(tokens)
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
            rt.backward(loss)
            if step == args.crash_at_step and rt.rank == args.crash_rank % rt.world_size:
                print(f"rank {rt.rank}: killing myself in the middle of step {step} (--crash-at-step)", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss_sum, since = loss_sum + loss.detach(), since + 1
            if step % args.log_every == 0 or step == args.steps:
                mean = float(rt.all_reduce(loss_sum / since, "mean"))
                rate = since / (time.perf_counter() - t0)
                rt.print(f"step {step:>5}/{args.steps}  loss {mean:.4f}  {rate:.1f} steps/s")
                loss_sum, since, t0 = torch.zeros(()), 0, time.perf_counter()
            state["step"] = step
            saved_at = time.perf_counter()
            if mgr.maybe_save(step, state, metrics={"loss": loss.item()}):
                _report_checkpoint(rt, mgr, step, time.perf_counter() - saved_at)
                t0 += time.perf_counter() - saved_at  # keep the step rate about training
        mgr.wait()
    finally:
        mgr.close()
    final = os.path.join(args.dir, "final")
    # a progress bar on rank 0's terminal (plain lines off a terminal, for saves past the interval)
    rt.save(final, state, overwrite=True, metadata={"step": args.steps}, progress=shardsafe.ProgressBar())
    rt.print(f"final state saved to {final}")
    return {"resumed_from": resumed, "steps": args.steps}


def _report_checkpoint(rt: Runtime, mgr: CheckpointManager, step: int, seconds: float) -> None:
    if not rt.is_global_zero:
        return
    record = next(r for r in reversed(mgr.list()) if r.step == step)
    rate = record.size / max(seconds, 1e-9) / 2**20
    rt.print(
        f"checkpoint {record.name}: {_mib(record.size)} in {seconds:.2f} s ({rate:.1f} MiB/s), "
        f"{len(record.files)} data file(s), committed"
    )


# -------------------------------------------------------------------------------------------- comparing


def compare(a: str, b: str) -> bool:
    """(one process) Whether the final states under run directories ``a`` and ``b`` hold the same bits."""
    bar = shardsafe.ProgressBar()
    left = shardsafe.load(os.path.join(a, "final"), progress=bar)
    return same_bits(left, shardsafe.load(os.path.join(b, "final"), progress=bar), a, b)


def same_bits(left_state: dict[str, Any], right_state: dict[str, Any], a: str = "a", b: str = "b") -> bool:
    """Every tensor (parameters and optimizer state) equal byte for byte, every other value equal; prints
    the verdict's details."""
    left, right = _flatten(left_state), _flatten(right_state)
    if left.keys() != right.keys():
        print(f"NOT EQUAL: the entries differ: {sorted(left.keys() ^ right.keys())}")
        return False
    n_bytes = n_tensors = 0
    for key in sorted(left):
        x, y = left[key], right[key]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            same = x.dtype == y.dtype and x.shape == y.shape and torch.equal(_bits(x), _bits(y))
            if not same:
                diff = (x.double() - y.double()).abs().max().item() if x.shape == y.shape else "shape"
                print(f"NOT EQUAL: tensor {key} differs (max abs difference {diff})")
                return False
            n_tensors, n_bytes = n_tensors + 1, n_bytes + x.numel() * x.element_size()
        elif type(x) is not type(y) or x != y:
            print(f"NOT EQUAL: value {key} is {x!r} in {a} but {y!r} in {b}")
            return False
    print(f"EQUAL: all {n_tensors} tensors ({_mib(n_bytes)} of parameters and optimizer state) are bitwise equal")
    return True


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else None
    if items is None:
        return {prefix.rstrip("/"): tree}
    out: dict[str, Any] = {}
    for k, v in items:
        out.update(_flatten(v, f"{prefix}{k}/"))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


# ------------------------------------------------------------------------------------------------- demo


def demo(args: argparse.Namespace) -> int:
    """(the launching process) Crash, resume, reference, compare: each step a separate invocation."""
    root = Path(args.dir)
    run, reference = root / "run", root / "reference"
    crash = args.crash_at_step or max(2, (args.steps * 5) // 8 - 1)
    for d in (run, reference):
        _fresh(d)
    common = _passthrough(args)
    print(
        f"== shardsafe example: {args.devices} process(es), {args.strategy} on {args.accelerator}, "
        f"{args.steps} steps, a checkpoint every {args.every} ==",
        flush=True,
    )
    print(f"\n[1/4] training into {run}; rank {args.crash_rank} is killed at step {crash}", flush=True)
    code = _invoke(["train", "--dir", str(run), "--crash-at-step", str(crash), *common])
    if code == 0:
        print("the run was expected to crash but finished; is --crash-at-step beyond --steps?")
        return 1
    print(
        "\n[2/4] the same command again (without the crash): it resumes from the last committed checkpoint", flush=True
    )
    if _invoke(["train", "--dir", str(run), *common]) != 0:
        return 1
    print(f"\n[3/4] a reference run into {reference}, never interrupted", flush=True)
    if _invoke(["train", "--dir", str(reference), *common]) != 0:
        return 1
    print("\n[4/4] comparing the final states of the two runs", flush=True)
    equal = compare(str(run), str(reference))
    print("VERDICT: " + ("resumed run == uninterrupted run, bit for bit" if equal else "the runs differ"), flush=True)
    return 0 if equal else 1


def _fresh(path: Path) -> None:
    if path.exists():
        if not (path / DEMO_MARKER).exists():
            raise SystemExit(f"{path} exists and was not made by this example; remove it or pick another --dir")
        shutil.rmtree(path)
    path.mkdir(parents=True)
    (path / DEMO_MARKER).write_text("made by examples/train.py demo; removed by the next demo run\n")


def _passthrough(args: argparse.Namespace) -> list[str]:
    out = []
    for name in ("strategy", "devices", "accelerator", "steps", "every", "keep_last", "seed", "vocab", "dim"):
        out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    for name in ("layers", "heads", "seq", "batch", "lr", "log_every", "crash_rank"):
        out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.timeout is not None:
        out += ["--timeout", str(args.timeout)]
    return out


def _invoke(argv: list[str]) -> int:
    print("$ python examples/train.py " + " ".join(argv), flush=True)
    return subprocess.run([sys.executable, os.path.abspath(__file__), *argv], check=False).returncode


# -------------------------------------------------------------------------------------------------- cli


def _millions(n: int) -> str:
    return f"{n / 1e6:.2f}M"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("command", nargs="?", default="demo", choices=("demo", "train", "compare"))
    p.add_argument("dirs", nargs="*", help="compare: the two run directories")
    p.add_argument("--strategy", default="fsdp", choices=("fsdp", "ddp", "single"))
    p.add_argument("--devices", type=int, default=None, help="processes (default 2; 1 for single)")
    p.add_argument("--accelerator", default="cpu", choices=("cpu", "cuda", "auto"))
    p.add_argument("--dir", default="checkpoints", help="checkpoint root (demo: parent of run/ and reference/)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--crash-at-step", type=int, default=None, help="kill a rank in the middle of this step")
    p.add_argument("--crash-rank", type=int, default=1, help="which rank --crash-at-step kills")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--timeout", type=float, default=None, help="seconds ranks wait for each other")
    args = p.parse_args(argv)
    if args.devices is None:
        args.devices = 1 if args.strategy == "single" else 2
    if args.command == "compare" and len(args.dirs) != 2:
        p.error("compare takes two run directories")
    if args.command != "compare" and args.dirs:
        p.error(f"{args.command} takes no positional arguments")
    return args


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse(argv)
    if args.command == "demo":
        return demo(args)
    if args.command == "compare":
        return 0 if compare(*args.dirs) else 1
    rt = Runtime(accelerator=args.accelerator, devices=args.devices, strategy=args.strategy, timeout=args.timeout)
    try:
        rt.launch(train, args)
    except WorkerError as err:
        if args.crash_at_step is None:
            raise
        print(f"the run crashed as asked: {err}", flush=True)
        return CRASH_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
