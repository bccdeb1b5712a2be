"""`gptkit runs` (the table), `gptkit compare` (the PNG) and `gptkit runs serve` (the page, in headless
Chromium) over small run folders written here in the files `gptkit train` writes (config.yaml, plan.json,
metrics.csv, checkpoints/last.ckpt, .lock): one of each status, and a damaged one."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from conftest import HANG_S, run_main, wait_for

from gptkit.fsio import lock_file

COLUMNS = (
    "step,train/lr,perf/tokens_per_s,perf/tokens,train/loss,train/grad_norm,val/loss,val/ppl,eval/tiny_mc/acc"
)
MODEL = dict(
    name="llama-tiny", vocab_size=256, max_seq_len=64, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32
)


def metrics_row(step: int, lr: float, val_every: int = 3) -> str:
    loss = 5.5 - step * 0.1 * (1 + lr * 1000)
    val = f"{loss + 0.05:.4f},{2.718 ** (loss + 0.05):.2f}" if step % val_every == 0 else ","
    acc = f"{0.25 + step * 0.01:.3f}" if step % 6 == 0 else ""
    return f"{step},{lr},{5000 + step},{step * 256},{loss:.4f},{1.0 / step:.3f},{val},{acc}\n"


def fake_run(root: Path, name: str, steps: int, max_steps: int, lr: float, ckpt: bool = True) -> Path:
    """A run folder as `gptkit train` leaves it after `steps` of `max_steps` steps (optim.lr=lr)."""
    run = root / name
    (run / "checkpoints").mkdir(parents=True)
    cfg = {"model": MODEL, "trainer": {"max_steps": max_steps, "batch_size": 4}, "optim": {"lr": lr}}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    plan = {"from_step": 1, "world_size": 1, "accumulation": 1, "batch_size": 4, "rows_per_item": 1}
    plan.update(seq_len=64, seed=1, max_steps=max_steps)
    (run / "plan.json").write_text(json.dumps({"invocations": [plan]}))
    (run / "manifest.json").write_text(json.dumps({"format": "gptkit-token-shards", "source": {"kind": "x"}}))
    (run / "samples.jsonl").write_text(
        json.dumps({"step": 3, "prompt": "ab", "text": f"sample of {name}"}) + "\n"
    )
    (run / "metrics.csv").write_text(
        COLUMNS + "\n" + "".join(metrics_row(s, lr) for s in range(1, steps + 1))
    )
    if ckpt:
        (run / "checkpoints" / "last.ckpt").write_bytes(b"\0" * 4096)
    (run / ".lock").write_text("999999\n")
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """done (12/12), stopped (6/12, saved where it stopped), failed (a row after its checkpoint), damaged (a
    row that is not numbers), running (its .lock held by this process)."""
    root = tmp_path_factory.mktemp("runs")
    fake_run(root, "done", 12, 12, 1e-3)
    # a signal's save: last.ckpt of its own, metrics.csv rewritten just after it (36 ms on a real SIGTERM)
    stopped = fake_run(root, "stopped", 6, 12, 3e-3)
    saved = (stopped / "checkpoints" / "last.ckpt").stat().st_mtime_ns
    os.utime(stopped / "metrics.csv", ns=(saved + 50_000_000, saved + 50_000_000))
    # kill -9 after the periodic checkpoint of step 6: last.ckpt is a hard link of step-000006.ckpt
    failed = fake_run(root, "failed", 7, 12, 1e-3)
    os.link(failed / "checkpoints" / "last.ckpt", failed / "checkpoints" / "step-000006.ckpt")
    damaged = fake_run(root, "damaged", 6, 12, 1e-3)
    with open(damaged / "metrics.csv", "a") as f:
        f.write("7,0.001,oops,1792,4.4,0.1,,,\n8,0.001,5008,2048,4.3,0.1,,,\n")
    live = fake_run(root, "sweep/0", 4, 12, 2e-3)
    fd = lock_file(live / ".lock")
    assert fd is not None
    yield root
    os.close(fd)


def test_runs_table_and_compare_png(runs, capsys, tmp_path):
    code, out, err = run_main(capsys, "runs", f"dir={runs}")
    assert code == 0, err
    # run, model, params, tokens, steps, best val loss, last evals, status, size, updated
    cells = {
        c[0]: c for c in ([x.strip() for x in ln.split("│")[1:-1]] for ln in out.splitlines() if "│" in ln)
    }
    assert {k: v[7] for k, v in cells.items()} == {
        "damaged": "damaged: metrics.csv line 8: 'oops' is not a number",
        "done": "done",
        "failed": "failed",
        "stopped": "stopped",
        "sweep/0": "running",
    }
    assert (
        cells["done"][4:7] == ["12/12", "3.1500 @12", "tiny_mc/acc 0.370"] and cells["stopped"][4] == "6/12"
    )
    code, out, _ = run_main(capsys, "runs", f"dir={runs}", "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["done"]["params"] > 0 and rows["done"]["tokens"] == 12 * 256
    assert rows["done"]["evals"] == {"eval/tiny_mc/acc": pytest.approx(0.37)}
    assert rows["done"]["best_val_step"] == 12 and rows["sweep/0"]["status"] == "running"
    # a row being appended (no newline yet) is not read: the run is not damaged, its last whole row counts
    half = fake_run(tmp_path / "half", "live", 6, 12, 1e-3)
    with open(half / "metrics.csv", "a") as f:
        f.write("7,0.001,50")
    code, out, _ = run_main(capsys, "runs", f"dir={tmp_path / 'half'}", "--json")
    (row,) = json.loads(out)
    assert code == 0 and row["status"] != "damaged" and row["step"] == 6 and row["problem"] is None
    # bad input: one line, exit 2
    (tmp_path / "empty").mkdir()
    for args, needle in (
        (("runs", f"dir={tmp_path / 'empty'}"), "no run folders under"),
        (("runs", f"dir={tmp_path / 'nowhere'}"), "is not a folder"),
        (("runs", "sideways", f"dir={runs}"), "is not something `gptkit runs` does"),
        (("compare", f"runs=[{runs / 'done'},{runs / 'damaged'}]"), "is not a number"),
        (("compare", f"runs=[{runs / 'done'},{tmp_path}]"), "is not a run folder"),
    ):
        code, out, err = run_main(capsys, *args)
        assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and needle in err, err
    png = tmp_path / "compare.png"
    code, out, err = run_main(capsys, "compare", f"runs=[{runs / 'done'},{runs / 'stopped'}]", f"out={png}")
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    print(f"compare picture: {png}")


def chromium() -> str | None:
    import shutil

    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def test_the_runs_page_overlays_two_runs_in_a_browser(runs, tmp_path):
    binary = chromium()
    if binary is None:
        pytest.skip("no Chromium binary on this machine (apt-get install chromium); .ci/run installs it")
    sync_api = pytest.importorskip("playwright.sync_api")
    httpx = pytest.importorskip("httpx")
    env = dict(os.environ)
    env.pop("GPTKIT_VERB", None)
    args = [sys.executable, "-m", "gptkit", "runs", "serve", f"dir={runs}", "port=0"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    shot = tmp_path / "runs-page.png"
    try:
        wait_for(lambda: any("listening on" in x for x in lines), proc, HANG_S)
        url = next(x for x in lines if "listening on" in x).split()[2]
        # a name that is not one of the runs is a 404 in JSON, never a path read
        r = httpx.get(f"{url}/api/series", params={"run": "../done"}, timeout=HANG_S)
        assert r.status_code == 404 and "no run" in r.json()["error"]["message"]
        r = httpx.get(f"{url}/api/series", params={"run": "damaged"}, timeout=HANG_S)
        assert r.status_code == 422 and "is not a number" in r.json()["error"]["message"]
        flags = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"]
        flags += ["--disable-background-networking", "--disable-component-update", "--disable-sync"]
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=binary, headless=True, args=flags)
            try:
                page = browser.new_page(viewport={"width": 1300, "height": 1000})
                page.set_default_timeout(HANG_S * 1000)
                page.goto(url + "/")
                page.wait_for_selector('tr[data-run="done"]')
                page.click('tr[data-run="done"] td.name')
                page.click('tr[data-run="sweep/0"] td.name')
                page.wait_for_selector('#charts[data-runs="2"]')
                overlaid = page.eval_on_selector(
                    'svg[data-panel="loss"]',
                    "s => [...s.querySelectorAll('polyline')].map(p => p.dataset.run)",
                )
                differ = page.locator("#configs tr.diff td:first-child").all_inner_texts()
                # live: the running run logs two more steps; the page shows them without a reload
                with open(runs / "sweep/0" / "metrics.csv", "a") as f:
                    f.write(metrics_row(5, 2e-3) + metrics_row(6, 2e-3))
                page.wait_for_selector('tr[data-run="sweep/0"][data-step="6"]')
                page.wait_for_selector(
                    'svg[data-panel="val loss"] polyline[data-run="sweep/0"][data-points="2"]'
                )
                status = page.inner_text('tr[data-run="damaged"] td.status')
                samples = page.text_content("#details")
                page.screenshot(path=str(shot), full_page=True)
            finally:
                browser.close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=HANG_S)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert sorted(overlaid) == ["done", "sweep/0"]
    assert set(differ) == {"optim.lr"}
    assert status == "damaged" and "sample of done" in samples and "sample of sweep/0" in samples
    assert shot.stat().st_size > 10_000
    print(f"runs page screenshot: {shot}")


def test_an_imported_or_merged_folder_is_done_not_stopped(tmp_path):
    """`gptkit import` and `gptkit merge` write weights and no metrics.csv: nothing is left to run."""
    from gptkit.runs_page.scan import run_status

    for name, marker in (("imported", "imported_from.json"), ("merged", "merge.json")):
        run = tmp_path / name
        (run / "checkpoints").mkdir(parents=True)
        (run / "checkpoints" / "last.ckpt").write_bytes(b"\0")
        assert run_status(run, None, None, running=False) == "stopped"  # before it: as a saved stop
        (run / marker).write_text("{}")
        assert run_status(run, None, None, running=False) == "done"
