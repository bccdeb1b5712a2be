"""Seeing inside a run: `gptkit trace` against the batches a training run drew (data=mix of text files and
JSON lines, accumulation), every kind's rows traced (chat, preference, token files), loss spikes, the
profiler, the memory measured against the estimate."""

import csv
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import run_main, shakespeare, tiny_run
from omegaconf import OmegaConf

from gptkit.commands.trace import trace
from gptkit.data import prepare
from gptkit.data.datamodule import TrainBatches
from gptkit.data.provenance import show
from gptkit.training.metrics import LossWindow, SpikeWatch
from gptkit.training.profile import busy_intervals, idle_share, parse_profile


def texts(n: int, start: int) -> list[str]:
    """n records of the built-in corpus, each a few lines."""
    text = shakespeare(60 * n + start)[start:]
    return [text[i * 60 : (i + 1) * 60] for i in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    (d / "a.txt").write_text(shakespeare(3_000))
    (d / "b.txt").write_text(shakespeare(2_000, start=10_000))
    (d / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts(40, 20_000)))
    return d


def separated(text: str) -> str:
    """A document as the shards hold it without an EOS token: ending with a newline."""
    return text if text.endswith("\n") else text + "\n"


def trace_cfg(run, step, **kw):
    return OmegaConf.create(
        {
            "run": str(run),
            "step": step,
            "rank": None,
            "micro_batch": None,
            "world_size": None,
            "chars": 40,
            "runs_dir": "runs",
            "format": "json",
            **kw,
        }
    )


def metrics_rows(run):
    with open(run / "metrics.csv", newline="") as f:
        return {int(r["step"]): {k: v for k, v in r.items() if v} for r in csv.DictReader(f)}


def test_trace_names_the_rows_a_run_drew_and_the_run_notes_spikes_profiles_and_memory(
    corpus, tmp_path, capsys, monkeypatch
):
    """One run (data=mix: two text files and a JSON-lines file; accumulation 2): every traced row is the
    window the sampler gave the run, its text the row's, and each document's place in its file holds that
    text; a loss spike (its measured loss made 5x at step 5) is one line naming `gptkit trace` and
    train/spike in metrics.csv; trainer.profile=2-3 writes the traces and the top operators; the memory
    measured after step 2 stands next to the estimate by part."""
    drawn = {}
    original = TrainBatches.__iter__

    def recorded(self):
        for i, b in enumerate(original(self)):
            drawn[self.start_step + i] = b[0].clone()
            yield b

    monkeypatch.setattr(TrainBatches, "__iter__", recorded)
    add = LossWindow.add
    monkeypatch.setattr(
        LossWindow,
        "add",
        lambda self, loss, step, tokens=None: add(self, loss * (5 if step == 4 else 1), step, tokens),
    )
    runs = tmp_path / "runs"
    sources = (
        f"data.sources={{prose: {{kind: files, paths: [{corpus / 'a.txt'}, {corpus / 'b.txt'}], weight: 1}}, "
        f"records: {{kind: files, paths: [{corpus / 'c.jsonl'}], weight: 1}}}}"
    )
    extra = [sources, "trainer.accumulate_grad_batches=2", "trainer.spike_window=3", "trainer.profile=2-3"]
    keys = dict(tokenizer=None, data="mix", batch_size=2, steps=6, val_every=6, val_windows=2, log_every=3)
    args = tiny_run(None, runs, "traced", *extra, **keys, progress="lines", threads=1, warmup=None)
    code, _, err = run_main(capsys, "train", *args)
    assert code == 0, err[-3000:]
    trained = err
    run = runs / "traced"
    plan = json.loads((run / "plan.json").read_text())["invocations"]
    assert plan == [
        {
            "from_step": 1,
            "world_size": 1,
            "accumulation": 2,
            "batch_size": 2,
            "rows_per_item": 1,
            "seq_len": 32,
            "seed": 1337,
            "max_steps": 6,
        }
    ]

    # every row of every step: the window the run drew, its text, and the document's place in its file
    saved = OmegaConf.load(run / "config.yaml")
    mixed = prepare(saved.data, saved.tokenizer, progress=False)
    parts = dict(zip(mixed.names, mixed.parts))
    tok = mixed.tokenizer()
    kinds = set()
    for step in range(1, 7):
        out = trace(trace_cfg(run, step))
        assert [b["micro_step"] for b in out["micro_batches"]] == [2 * step - 2, 2 * step - 1]
        for b in out["micro_batches"]:
            x = drawn[b["micro_step"]]
            assert len(b["rows"]) == len(x) == 2
            for row in b["rows"]:
                start = int(row["position"].split()[1].replace(",", ""))
                tokens = np.asarray(parts[row["part"]].train_tokens()[start : start + 32], dtype=np.int64)
                assert torch.equal(x[row["row"]], torch.from_numpy(tokens)), (step, row)
                assert row["text"] == show(tok.decode(tokens.tolist()), 40)
                assert sum(s["tokens"] for s in row["spans"]) == 32
                first = row["spans"][0]
                head = tok.decode(tokens[: first["tokens"]].tolist()).encode()[:12]
                source, where = first["source"], first["where"]
                if source.endswith(".txt"):
                    kinds.add("text")
                    at = int(where.split()[1].replace(",", ""))
                    text = separated((corpus / source.rsplit("/", 1)[1]).read_text())
                    assert text.encode()[at : at + len(head)] == head
                else:
                    kinds.add("jsonl")
                    line = int(where.split()[1].replace(",", ""))
                    record = json.loads((corpus / "c.jsonl").read_text().splitlines()[line - 1])["text"]
                    inner = (
                        int(where.split("byte ")[2].split()[0].replace(",", "")) if ", byte" in where else 0
                    )
                    assert separated(record).encode()[inner : inner + len(head)] == head, (where, head)
                    assert first["document"] == line - 1
    assert kinds == {"text", "jsonl"}

    # the CLI: one micro-batch as JSON; a step beyond the run is one line
    code, out, _ = run_main(capsys, "trace", f"run={run}", "step=3", "micro_batch=1", "--json")
    assert code == 0 and json.loads(out)["micro_batches"][0]["micro_step"] == 5
    code, _, err = run_main(capsys, "trace", f"run={run}", "step=7")
    assert code == 2 and err.strip().splitlines()[-1].startswith("error: step=7 is beyond the run")
    # a run of an older gptkit (no plan.json): its draws planned from its saved config, the same rows
    want = trace(trace_cfg(run, 4))
    (run / "plan.json").unlink()
    assert trace(trace_cfg(run, 4))["micro_batches"] == want["micro_batches"]

    rows = metrics_rows(run)
    # the spike: step 5, noted once, with the command that explains it
    spikes = [s for s, r in rows.items() if "train/spike" in r]
    assert spikes == [5] and float(rows[5]["train/spike"]) > 3 and "train/spike_loss" in rows[5]
    noted = [line for line in trained.splitlines() if line.startswith("loss spike")]
    assert len(noted) == 1 and noted[0].endswith(f"gptkit trace run={run} step=5"), noted
    # profile: the traces, their TensorBoard copy, the top operators (printed and kept)
    assert json.loads((run / "profile" / "trace.json").read_text())["traceEvents"]
    assert list((run / "profile" / "tensorboard").glob("*.pt.trace.json"))
    assert "aten::" in (run / "profile" / "top.txt").read_text() and "profile of steps 2-3" in trained
    # the memory after step 2 by part, on the next log step's row (3) and in the log
    memory = {
        "perf/memory_peak",
        "perf/memory_estimate",
        "perf/memory_estimate_weights",
        "perf/memory_peak_rss",
    }
    assert memory <= set(rows[3]) and "memory after step 3: peak" in trained


def jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_chat_preference_token_and_prompt_rows_are_traced_to_their_file_and_line(tmp_path):
    """data=chat (packed rows of conversations), data=preference (pairs, one pair left out by
    truncate=drop), data=tokens (offsets only) and data=prompts (GRPO's prompts): each traced row is the row
    the sampler draws, named by the records (file and line) or token files (token and byte offset) it came
    from."""
    convs = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": t[:20]}]}
        for i, t in enumerate(texts(16, 0))
    ]
    chat = jsonl(tmp_path / "chat.jsonl", convs)
    data = prepare(
        {"kind": "chat", "paths": [str(chat)], "template": "chatml", "val_fraction": 0.2},
        {"kind": "byte"},
        cache_dir=tmp_path / "c",
        progress=False,
    )
    feed = data.connect(2, 128, 7, 1)
    tok = data.tokenizer()
    held = 0
    for step in range(4):
        rows, x = feed.trace(step, 1, 2), feed.sampler.batch(step, 1, 2)[0]
        assert [o.row for o in rows] == [0, 1]
        for o in rows:
            assert o.text == show(tok.decode(x[o.row].tolist(), skip_special_tokens=False), 80)
            full = tok.decode(x[o.row].tolist())
            for s in o.spans:
                n = int(s.where.split()[1])
                assert s.source == str(chat) and s.document == n - 1
                assert convs[n - 1]["messages"][1]["content"] in full
            held = max(held, len(o.spans))
    # rows hold several conversations (data.pack=documents)
    assert held >= 2
    pairs = [{"prompt": f"upper {t[:5]}", "chosen": t.upper(), "rejected": t} for t in texts(6, 300)]
    pairs[1]["chosen"] = "x" * 200
    pref = jsonl(tmp_path / "pairs.jsonl", pairs)
    data = prepare(
        {
            "kind": "preference",
            "paths": [str(pref)],
            "val_paths": [str(pref)],
            "template": "chatml",
            "truncate": "drop",
        },
        {"kind": "byte"},
        cache_dir=tmp_path / "c",
        progress=False,
    )
    feed = data.connect(2, 128, 3, 1)
    for step in range(3):
        rows, x = feed.trace(step), feed.sampler.batch(step)[0]
        assert len(rows) == 4
        for o in rows:
            (s,) = o.spans
            side = ("chosen", "rejected")[o.row % 2]
            assert s.where == f"line {s.document + 1}, the {side} answer" and s.document != 1
            answer = pairs[s.document][side]
            assert o.text == show(data.tokenizer().decode(x[o.row].tolist(), skip_special_tokens=False), 80)
            assert answer[:10] in data.tokenizer().decode(x[o.row].tolist())
    ids = [np.arange(i, i + 3000, dtype=np.uint16) % 256 for i in range(2)]
    files = [tmp_path / f"t{i}.bin" for i in range(2)]
    for f, a in zip(files, ids):
        a.tofile(f)
    data = prepare(
        {"kind": "tokens", "paths": [str(f) for f in files], "val_fraction": 0.1},
        {"kind": "byte"},
        cache_dir=tmp_path / "c",
        progress=False,
    )
    feed = data.connect(4, 32, 1, 1)
    every = np.concatenate(ids)
    for step in range(5):
        for o, row in zip(feed.trace(step), feed.sampler.batch(step)[0]):
            got = []
            for s in o.spans:
                token = int(s.where.split()[1].replace(",", ""))
                assert int(s.where.split("byte ")[1].rstrip(")").replace(",", "")) == 2 * token
                got += np.fromfile(s.source, dtype=np.uint16)[token : token + s.tokens].tolist()
            assert got == row.tolist() and s.document is None
            start = int(o.position.split()[1].replace(",", ""))
            assert every[start : start + 32].tolist() == got
    # data=prompts (objective=grpo samples each prompt's completions): each prompt, its file and line
    prompts = jsonl(
        tmp_path / "prompts.jsonl", [{"prompt": f"upper {t[:6]}", "answer": t[:6]} for t in texts(12, 9)]
    )
    data = prepare(
        {"kind": "prompts", "paths": [str(prompts)], "template": "chatml", "val_fraction": 0.2},
        {"kind": "byte"},
        cache_dir=tmp_path / "c",
        progress=False,
    )
    feed = data.connect(3, 64, 5, 1)
    for step in range(3):
        batch = feed.sampler.batch(step, 1, 2)
        rows = feed.trace(step, 1, 2)
        assert [o.row for o in rows] == [0, 1, 2]
        for o, ids, n, where, rec in zip(rows, batch.ids, batch.lengths, batch.where, batch.rows):
            (s,) = o.spans
            assert f"{s.source} {s.where}" == where and s.tokens == int(n)
            assert o.text == show(data.tokenizer().decode(ids[:n].tolist(), skip_special_tokens=False), 80)
            assert rec["prompt"] in data.tokenizer().decode(ids[:n].tolist())


def test_a_spike_is_a_step_above_the_factor_times_the_median_before_it():
    watch = SpikeWatch(1.5, 4)
    seen = [watch.observe(x) for x in (4.0, 3.9, 3.8, 3.7, 6.0, 3.6, 3.5, 3.4, 3.3, 20.0)]
    # at least min(10, window) = 4 steps known; 6.0 over 1.5 x median(4.0, 3.9, 3.8, 3.7)
    assert [i for i, r in enumerate(seen) if r] == [4, 9]
    assert seen[4] == pytest.approx(6.0 / 3.85) and seen[9] == pytest.approx(20.0 / 3.45)


def test_the_profile_range_and_the_gpus_idle_share(capsys, tmp_path):
    """trainer.profile is N or N-M; the idle share counts the device's busy intervals once (the GPU branch:
    CUDA events of a profile, made here as the profiler makes them)."""
    from torch.autograd import DeviceType

    assert parse_profile("10-12") == (10, 12) and parse_profile(7) == (7, 7) and parse_profile(None) is None
    for bad in ("0-3", "5-2", "a", "1-2-3", True):
        with pytest.raises(Exception, match="trainer.profile"):
            parse_profile(bad)
    # a range outside the run: one line before any data is prepared
    code, _, err = run_main(
        capsys, "train", "trainer.max_steps=3", "trainer.profile=2-5", f"runs_dir={tmp_path}"
    )
    assert code == 2 and err.strip().splitlines() == [
        "error: trainer.profile=2-5 is outside the run: this invocation trains steps 1..3 "
        "(trainer.max_steps=3)"
    ]

    def event(device, start, end):
        return SimpleNamespace(device_type=device, time_range=SimpleNamespace(start=start, end=end))

    events = [
        event(DeviceType.CPU, 0, 100),
        event(DeviceType.CUDA, 10, 30),
        event(DeviceType.CUDA, 20, 40),
        event(DeviceType.CUDA, 60, 70),
    ]
    busy = busy_intervals(events)
    assert busy == [(10.0, 30.0), (20.0, 40.0), (60.0, 70.0)]
    # busy 10-40 and 60-70 of 0-100
    assert idle_share(busy, 0, 100) == pytest.approx(0.6)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux: the peak RSS is reset there")
def test_the_peak_rss_is_counted_from_the_run_not_from_the_process_earlier_peak():
    """A run trained in a process that held more memory earlier (a test worker, a bench in one process)
    measures its own peak above its RSS before the model: the process's earlier peak reset (it once logged
    a negative perf/memory_peak, the lifetime peak read against a later RSS)."""
    import mmap

    from gptkit.training.peak_memory import peak_rss, reset_peak_rss

    def touched(n: int) -> mmap.mmap:
        """n bytes of new anonymous pages, every page written: resident. (Not malloc's: a bytearray can be
        carved out of free heap memory still resident from the worker's earlier tests, and then the RSS does
        not grow: CI saw it once.)"""
        pages = mmap.mmap(-1, n)
        for at in range(0, n, mmap.PAGESIZE):
            pages[at] = 1
        return pages

    earlier = touched(256 << 20)  # 256 MiB, resident, then handed back
    earlier.close()
    before = reset_peak_rss()
    assert 0 <= peak_rss() - before < 32 << 20
    held = touched(64 << 20)
    assert peak_rss() - before >= 60 << 20
    held.close()
