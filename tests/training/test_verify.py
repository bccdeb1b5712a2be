"""`gptkit verify`'s plumbing (the invariants themselves run in `.ci/verify`, minutes each): bad input is one
line, the report is one line per invariant and the exit status says whether one failed, the tiny model keeps
its family, the batch-4 run of the accumulation check sees the accumulating run's rows."""

import numpy as np
import pytest
import torch
from conftest import run_main
from omegaconf import OmegaConf

from gptkit.conf_tree import compose
from gptkit.data.datamodule import TrainBatches
from gptkit.data.windows import WindowSampler
from gptkit.errors import GptkitError
from gptkit.model.config import ModelConfig
from gptkit.training import verify as v


def test_bad_input_is_one_line_before_anything_runs(capsys, tmp_path):
    code, _, err = run_main(capsys, "verify", "invariants=[ranks,warp]")
    assert (
        code == 2
        and err.strip()
        == "error: unknown invariant 'warp'; verify checks ranks, accumulation, resume, packing, export"
    )
    (tmp_path / "mine.txt").write_text("not verify's")
    code, _, err = run_main(capsys, "verify", f"dir={tmp_path}", "invariants=[packing]")
    assert code == 2 and "holds files verify did not write" in err and (tmp_path / "mine.txt").exists()
    code, _, err = run_main(capsys, "verify", "steps=3")
    assert code == 2 and "steps=3 must be >= 6" in err


def test_one_line_per_invariant_and_the_exit_status(monkeypatch, tmp_path, capsys):
    verdicts = {
        "ranks": lambda r: v.Result("ranks", "ok", "same"),
        "accumulation": lambda r: v.Result("accumulation", "skip", "n/a"),
        "export": lambda r: (_ for _ in ()).throw(GptkitError("no exporter for it")),
    }
    monkeypatch.setattr(v, "INVARIANTS", {**v.INVARIANTS, **verdicts})
    # the run the invariants compare with: not needed by these verdicts
    monkeypatch.setattr(v.Rehearsal, "reference", lambda self: self.dir / "reference")
    cfg = compose(
        "verify", ["model=llama-tiny", "invariants=[ranks,accumulation,export]", f"dir={tmp_path / 'v'}"]
    )
    assert v.verify(cfg) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("gptkit verify: llama-tiny at tiny width (2 layers, d_model 64, 4 heads / 2 kv")
    assert [line.split()[0] for line in out[1:4]] == ["ok", "skip", "FAIL"]
    assert "GptkitError: no exporter for it" in out[3] and out[4] == "2 of 3 invariants hold; 1 failed"
    # the folder is verify's: a second verify there replaces its runs
    assert (tmp_path / "v" / v.MARK).is_file()
    monkeypatch.setattr(v, "INVARIANTS", {**v.INVARIANTS, "export": lambda r: v.Result("export", "ok", "")})
    assert v.verify(cfg) == 0


def test_the_tiny_model_keeps_its_family():
    llama = OmegaConf.to_container(compose("train", ["model=llama3.1-8b"]).model)
    tiny = v.tiny_model(llama)
    # GQA 32:8 -> 4:1, RoPE scaling, SwiGLU, RMSNorm kept; 2 layers of 64
    assert (tiny["n_heads"], tiny["n_kv_heads"], tiny["n_layers"], tiny["d_model"]) == (4, 1, 2, 64)
    assert tiny["rope_scaling"]["type"] == "llama3" and tiny["mlp"] == "swiglu" and tiny["norm"] == "rmsnorm"
    moe = v.tiny_model(OmegaConf.to_container(compose("train", ["model=moe-tiny"]).model))
    assert moe["moe"]["n_experts"] == 4 and moe["moe"]["top_k"] == 2
    # a layer per type kept: Gemma 3's local and global, a hybrid's linear and global
    for preset, types in (("gemma3-tiny", ["local", "global"]), ("gdn-tiny", ["linear", "global"])):
        tiny = v.tiny_model(OmegaConf.to_container(compose("train", [f"model={preset}"]).model))
        assert tiny["layer_types"] == types and ModelConfig.from_dict(tiny).n_layers == 2


def test_the_joined_run_sees_the_rows_the_accumulating_run_draws():
    tokens = np.arange(5000, dtype=np.uint16) % 256
    four, two = WindowSampler(tokens, 4, 16, 7), WindowSampler(tokens, 2, 16, 7)
    with v.joined_micro_batches(2):
        batches = iter(TrainBatches(four, 3, 0, 1))
        for step in (3, 4):
            x, y = next(batches)
            want = [two.batch(2 * step + m) for m in (0, 1)]
            assert torch.equal(x, torch.cat([w[0] for w in want])) and torch.equal(
                y, torch.cat([w[1] for w in want])
            )
    # outside it, a run draws as always
    assert torch.equal(next(iter(TrainBatches(four, 3, 0, 1)))[0], four.batch(3)[0])


@pytest.mark.parametrize("names", ["ranks", [], None])
def test_invariants_must_be_a_list_of_names(names):
    with pytest.raises(GptkitError, match="invariants="):
        v.check_invariants(names)
