"""End to end with transformers: a tiny GPT-2 (built from a config, nothing downloaded) trained 2 steps
on 2 FSDP2 ranks and saved with shardsafe and with DCP; exported in the Hugging Face layout and opened
with ``from_pretrained`` (same logits), in bfloat16; the DCP folder and a torch.save file imported.
Also how tied weights are decided (the model's declaration, then equal bytes)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.cli import main

from harness import check_ok, run_ranks
from models import FSDP2_ON_CPU_PROBLEM

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402  (after the skip: safetensors comes with transformers)

VOCAB, SEQ = 256, 16
BLOCK = 4096  # small checksum blocks at save, so exported tensors span several blocks and pieces


def gpt2_config() -> Any:
    from transformers import GPT2Config

    return GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=SEQ,
        bos_token_id=0,
        eos_token_id=0,
        architectures=["GPT2LMHeadModel"],  # as save_pretrained writes it
    )


def probe() -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(7))


def _full(value: Any) -> Any:
    if hasattr(value, "full_tensor"):
        return value.full_tensor().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_full(v) for v in value)
    return value


def _train_and_save(rank: int, world: int, ckpt: str, dcp_dir: str) -> dict[str, Any]:
    """(every rank) Train GPT-2 under FSDP2 for 2 steps; save with shardsafe and with DCP; return the
    model's own logits on a probe batch and the whole state (gathered: test only)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config())
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(100 * step + rank))
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    mesh = init_device_mesh("cpu", (world,))
    columns = torch.arange(6 * 10, dtype=torch.float32).reshape(6, 10)  # sharded by columns: not row-major
    wte = model.transformer.wte.weight.full_tensor().detach().clone()  # one chunk, where FSDP2 wrote two
    changed = wte.clone()
    changed[-1, -1] += 1
    extra = {"columns": distribute_tensor(columns, mesh, [Shard(1)]), "note": "cols", "wte": wte, "changed": changed}
    shardsafe.save(ckpt, {"model": model, "optimizer": opt, "step": 2, "extra": extra}, timeout=60)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save(
        {"model": model_sd, "optim": optim_sd, "step": 2, "meta": {"lr": 0.01, "tag": "gpt2"}}, checkpoint_id=dcp_dir
    )
    full = {"model": _full(model.state_dict()), "optim": _full(optim_sd), "columns": columns}
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=probe()).logits  # the trained model's own forward, under FSDP2
    return {"logits": logits, **full}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if FSDP2_ON_CPU_PROBLEM is not None:
        pytest.skip(f"{FSDP2_ON_CPU_PROBLEM}: the GPT-2 model is trained with fully_shard on 2 CPU ranks")
    root = tmp_path_factory.mktemp("gpt2")
    ckpt, dcp_dir = str(root / "ckpt"), str(root / "dcp")
    env = {"SHARDSAFE_CHECKSUM_BLOCK_BYTES": str(BLOCK), "HF_HUB_OFFLINE": "1"}
    results = check_ok(run_ranks(_train_and_save, 2, ckpt, dcp_dir, timeout=180, env=env))
    config = root / "config.json"
    gpt2_config().to_json_file(str(config))
    return {**results[0], "root": root, "ckpt": ckpt, "dcp": dcp_dir, "config": str(config)}


def _logits(path: str, **kwargs: Any) -> torch.Tensor:
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(path, **kwargs).eval()
    with torch.no_grad():
        return model(input_ids=probe()).logits  # type: ignore[no-any-return]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (safe_open is not a dict)
    return out


def test_fsdp2_gpt2_export_opens_with_from_pretrained(
    trained: dict[str, Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHARDSAFE_EXPORT_SLAB_BYTES", str(3 * BLOCK))  # several pieces per tensor
    out = trained["root"] / "hf"
    argv = ["export", trained["ckpt"], str(out), "--max-shard-size", "100KB", "--config", trained["config"]]
    assert main(argv) == 0
    line = capsys.readouterr().out
    assert "lm_head.weight (tied to transformer.wte.weight)" in line, line
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) >= 4 and shards == sorted(set(index["weight_map"].values())), shards
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert all((out / s).stat().st_size <= 100_000 + 4096 for s in shards)  # limit + header
    weights = _weights(out)
    model = trained["model"]
    assert sorted(weights) == sorted(k for k in model if k != "lm_head.weight") == sorted(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in weights.values())
    for k, v in weights.items():
        assert v.dtype == model[k].dtype and torch.equal(v, model[k]), k
    assert json.loads((out / "config.json").read_text())["n_embd"] == 64
    assert torch.equal(_logits(str(out)), trained["logits"])


def test_bfloat16_export(trained: dict[str, Any]) -> None:
    out = trained["root"] / "hf-bf16"
    result = shardsafe.export_hf(trained["ckpt"], out, dtype="bfloat16", config=trained["config"])
    assert result.files == ["model.safetensors"] and not (out / "model.safetensors.index.json").exists()
    weights = _weights(out)
    for k, v in weights.items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, trained["model"][k].to(torch.bfloat16)), k
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    logits = _logits(str(out))
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), trained["logits"], atol=0.1, rtol=0.05)


def test_without_config_every_tensor_is_written_and_still_loads(trained: dict[str, Any]) -> None:
    out = trained["root"] / "hf-noconfig"
    result = shardsafe.export_hf(trained["ckpt"], out)
    assert result.tied == {} and "lm_head.weight" in _weights(out)
    gpt2_config().to_json_file(str(out / "config.json"))  # added by hand afterwards, as a user may
    assert torch.equal(_logits(str(out)), trained["logits"])


def test_column_sharded_tensor_and_torch_format(trained: dict[str, Any]) -> None:
    out = trained["root"] / "extra"
    result = shardsafe.export_hf(trained["ckpt"], out, key="extra")
    assert result.skipped == ["note"] and result.tensors == 3
    assert torch.equal(_weights(out)["columns"], trained["columns"])
    file = trained["root"] / "model.pt"
    assert main(["export", trained["ckpt"], str(file), "--format", "torch"]) == 0
    whole = torch.load(file, weights_only=True)
    assert sorted(whole) == sorted(trained["model"])
    assert all(torch.equal(whole[k], v) for k, v in trained["model"].items())


def _assert_equal(a: Any, b: Any, where: str = "", ordered: bool = True) -> None:
    """Same structure, types and values; dict key order too when ``ordered`` (DCP sorts keys)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        keys_a, keys_b = (list(a), list(b)) if ordered else (sorted(a), sorted(b))
        assert isinstance(b, dict) and keys_a == keys_b, (where, keys_a, keys_b)
        for k in a:
            _assert_equal(a[k], b[k], f"{where}/{k}", ordered)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_equal(x, y, f"{where}/{i}", ordered)
    else:
        assert a == b and type(a) is type(b), (where, a, b)


def test_dcp_import_needs_allow_pickle_then_loads_back_equal(
    trained: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    dest = trained["root"] / "from-dcp"
    assert main(["import", trained["dcp"], str(dest)]) == 2
    err = capsys.readouterr().err
    assert "pickle" in err and "--allow-pickle" in err and trained["dcp"] in err, err
    assert not dest.exists()
    assert main(["import", trained["dcp"], str(dest), "--allow-pickle"]) == 0
    loaded = shardsafe.load(dest)
    assert sorted(loaded) == ["meta", "model", "optim", "step"]
    assert loaded["step"] == 2 and loaded["meta"] == {"lr": 0.01, "tag": "gpt2"}
    _assert_equal(trained["model"], loaded["model"], "model", ordered=False)
    _assert_equal(trained["optim"], loaded["optim"], "optim", ordered=False)


def test_torch_save_import_keeps_structure(trained: dict[str, Any]) -> None:
    src = trained["root"] / "plain.pt"
    state = {
        "model": trained["model"],
        "optimizer": {"state": {0: {"step": torch.tensor(2.0)}}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]},
        "epoch": 3,
        "nested": {"a": {"b": [torch.arange(5), None, "x", 2.5]}},
    }
    torch.save(state, src)
    result = shardsafe.import_checkpoint(src, trained["root"] / "from-pt")
    assert result.keys == list(state) and result.source_format == "torch.save" and not result.wrapped
    _assert_equal(state, shardsafe.load(result.path))
    # and the imported model exports like the one saved by FSDP2
    out = trained["root"] / "hf-from-pt"
    shardsafe.export_hf(result.path, out, key="model", config=trained["config"])
    assert torch.equal(_logits(str(out)), trained["logits"])


def _untrained(tmp_path: Path, untie: bool) -> tuple[Path, dict[str, torch.Tensor]]:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(1)
    model = GPT2LMHeadModel(gpt2_config())
    if untie:  # a head that is its own tensor, with other values, under a config that still ties
        model.lm_head.weight = torch.nn.Parameter(model.transformer.wte.weight.detach() * 2)
    shardsafe.save(tmp_path / "ckpt", {"model": model})
    return tmp_path / "ckpt", {k: v.detach() for k, v in model.state_dict().items()}


def test_equal_bytes_alone_do_not_make_a_tie(tmp_path: Path) -> None:
    """Untrained: every LayerNorm weight is ones and every bias zeros (equal bytes, same shapes), yet
    only the head is tied: only it is left out."""
    ckpt, sd = _untrained(tmp_path, untie=False)
    assert torch.equal(sd["transformer.h.0.ln_1.bias"], sd["transformer.h.1.ln_1.bias"])
    config = json.loads(gpt2_config().to_json_string())
    result = shardsafe.export_hf(ckpt, tmp_path / "hf", config=config)
    assert result.tied == {"lm_head.weight": "transformer.wte.weight"}
    assert sorted(_weights(tmp_path / "hf")) == sorted(k for k in sd if k != "lm_head.weight")
    untied = shardsafe.export_hf(ckpt, tmp_path / "hf-untied", config={**config, "tie_word_embeddings": False})
    assert untied.tied == {} and sorted(_weights(tmp_path / "hf-untied")) == sorted(sd)
    kept = shardsafe.export_hf(ckpt, tmp_path / "hf-keep", config=config, tied="keep")
    assert kept.tied == {}


def test_declared_tie_with_different_bytes_writes_both(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ckpt, sd = _untrained(tmp_path, untie=True)
    config = json.loads(gpt2_config().to_json_string())
    result = shardsafe.export_hf(ckpt, tmp_path / "hf", config=config)
    assert result.tied == {}
    assert torch.equal(_weights(tmp_path / "hf")["lm_head.weight"], sd["lm_head.weight"])
    assert "holds different values" in caplog.text


def test_equal_bytes_across_different_chunk_layouts(trained: dict[str, Any]) -> None:
    """Two chunks (FSDP2) against one (a plain copy): compared by reading both, not by checksums."""
    from shardsafe.engine.read import read_manifest
    from shardsafe.interop.stream import PieceReader, same_bytes
    from shardsafe.storage import LocalStorage

    manifest = read_manifest(LocalStorage(), trained["ckpt"])
    assert manifest.strategy == "fsdp" and manifest.world_size == 2
    assert len(manifest.tensors["model/transformer.wte.weight"].chunks) == 2
    assert len(manifest.tensors["extra/wte"].chunks) == 1
    reader = PieceReader(LocalStorage(), trained["ckpt"], manifest, 8192, 60.0)
    try:
        assert same_bytes(manifest, reader, "model/transformer.wte.weight", "extra/wte", 8192)
        assert not same_bytes(manifest, reader, "model/transformer.wte.weight", "extra/changed", 8192)
        assert not same_bytes(manifest, reader, "model/transformer.wte.weight", "model/transformer.wpe.weight", 8192)
    finally:
        reader.close()
