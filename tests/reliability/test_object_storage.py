"""Issue 51 item 4: runs, prepared data and exports in an S3 bucket (gptkit/remote.py), against moto's S3
server on 127.0.0.1 (a free port, started once for the module; a bucket per test): checkpoints uploaded
with a manifest of SHA-256s and COMPLETE last, a reader that takes only complete, matching ones, the
credentials never written anywhere, and a kill -9 in the middle of an upload that loses nothing."""

import hashlib
import json
import os
import signal
import socket
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import run_cli, run_main, tiny_run

from gptkit import remote
from gptkit.errors import GptkitError

SECRET = "gptkit-test-secret-3f9a7c21"
# the s3:// options each verb takes (every other path option still refuses a URL: test_inputs.py)
S3_OPTIONS = [
    ("train", "runs_dir"),
    ("train", "resume"),
    ("train data=prepared", "data.dir"),
    ("prepare data=files data.paths=[corpus.txt]", "cache_dir"),
    ("sample", "run"),
    ("eval", "run"),
    ("export", "run"),
    ("export run=runs/x", "out"),
    ("import out=runs/y", "hf"),
]


@pytest.fixture(scope="module")
def s3_server():
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3(s3_server, tmp_path, monkeypatch):
    """A fresh bucket on the module's server, this process's environment pointed at it (GPTKIT_CACHE in the
    test's folder); .env is that environment for a subprocess."""
    import boto3

    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_ENDPOINT_URL": s3_server,
        "AWS_DEFAULT_REGION": "us-east-1",
        "GPTKIT_CACHE": str(tmp_path / "node1"),
    }
    for k in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    bucket = f"gptkit-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    client.create_bucket(Bucket=bucket)
    remote.reset()
    yield SimpleNamespace(env=env, bucket=bucket, url=f"s3://{bucket}", client=client)
    remote.reset()


def keys(s3, prefix: str = "") -> list[str]:
    pages = s3.client.get_paginator("list_objects_v2").paginate(Bucket=s3.bucket, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def body(s3, key: str) -> bytes:
    return s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read()


def complete(s3, run: str) -> list[str]:
    """The checkpoint folders of a remote run with COMPLETE."""
    return sorted(k.split("/")[-2] for k in keys(s3, f"{run}/checkpoints/") if k.endswith("/COMPLETE"))


def holds_secret(folder: Path) -> list[Path]:
    return [p for p in Path(folder).rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]


def metric_steps(csv: bytes) -> list[int]:
    lines = csv.decode().splitlines()
    col = lines[0].split(",").index("step")
    return [int(line.split(",")[col]) for line in lines[1:] if line.split(",")[col]]


def test_prepare_train_sample_export_import_through_a_bucket(s3, corpus, tmp_path, capsys, monkeypatch):
    # prepare publishes the shards once (COMPLETE last); a second prepare finds them there
    prepare = (
        "prepare",
        "data=files",
        f"data.paths=[{corpus}]",
        "tokenizer=char",
        f"cache_dir={s3.url}/cache",
    )
    code, out, err = run_main(capsys, *prepare)
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("published: "))
    data_url = line.split("data.dir=")[1].strip()
    name = data_url.rsplit("/", 1)[1]
    there = {k.split("/")[-1] for k in keys(s3, f"cache/{name}/")}
    manifest = json.loads(body(s3, f"cache/{name}/gptkit-remote.json"))
    assert {"train.bin", "val.bin", "manifest.json", "tokenizer.json"} <= set(manifest["files"])
    assert there == set(manifest["files"]) | {"gptkit-remote.json", "COMPLETE"}
    code, out, err = run_main(capsys, *prepare)
    assert code == 0 and f"already published: data=prepared data.dir={data_url}" in out, out + err

    # another node (its own GPTKIT_CACHE) trains from the bucket's data into the bucket
    node2 = tmp_path / "node2"
    monkeypatch.setenv("GPTKIT_CACHE", str(node2))
    args = tiny_run(None, f"{s3.url}/runs", "r", f"data.dir={data_url}", data="prepared", steps=6)
    code, out, err = run_main(capsys, "train", *args)
    assert code == 0, err[-3000:]
    staged = node2 / "remote/s3" / s3.bucket / "runs/r"
    assert complete(s3, "runs/r") == ["step-000003", "step-000006"]
    for step in ("step-000003", "step-000006"):
        manifest = json.loads(body(s3, f"runs/r/checkpoints/{step}/gptkit-remote.json"))
        entry = manifest["files"][f"{step}.ckpt"]
        local = (staged / "checkpoints" / f"{step}.ckpt").read_bytes()
        assert entry == {"size": len(local), "sha256": hashlib.sha256(local).hexdigest()}
        mark = body(s3, f"runs/r/checkpoints/{step}/COMPLETE").decode()
        assert mark == hashlib.sha256(body(s3, f"runs/r/checkpoints/{step}/gptkit-remote.json")).hexdigest()
    assert metric_steps(body(s3, "runs/r/metrics.csv")) == [1, 2, 3, 4, 5, 6]
    assert {"config.yaml", "tokenizer.json", "plan.json", "manifest.json"} <= {
        k.split("/")[-1] for k in keys(s3, "runs/r/")
    }
    # the credentials: in no file of either node, in no object, in no output
    assert SECRET not in out + err
    assert holds_secret(tmp_path) == []
    assert all(SECRET.encode() not in body(s3, k) for k in keys(s3))

    # a third node samples the run: its newest complete checkpoint, downloaded and checked
    node3 = tmp_path / "node3"
    monkeypatch.setenv("GPTKIT_CACHE", str(node3))
    code, out, err = run_main(
        capsys, "sample", f"run={s3.url}/runs/r", "prompt=To", "max_new_tokens=3", "device=cpu"
    )
    assert code == 0, err
    got = node3 / "remote/s3" / s3.bucket / "runs/r/checkpoints"
    want = (staged / "checkpoints/step-000006.ckpt").read_bytes()
    assert (got / "last.ckpt").read_bytes() == want and (got / "step-000006.ckpt").read_bytes() == want

    # an export never empties a run's staging folder (out= the run's own location)
    code, _, err = run_main(capsys, "export", f"run={s3.url}/runs/r", f"out={s3.url}/runs/r")
    assert code == 2 and err.count("\n") == 1 and "is where a run is kept" in err, err
    assert (got / "last.ckpt").read_bytes() == want
    # export to the bucket, import from it
    code, out, err = run_main(capsys, "export", f"run={s3.url}/runs/r", f"out={s3.url}/exports/r")
    assert code == 0 and f"published {s3.url}/exports/r" in err, err
    assert "exports/r/COMPLETE" in keys(s3) and "exports/r/config.json" in keys(s3)
    code, out, err = run_main(capsys, "import", f"hf={s3.url}/exports/r", f"out={tmp_path / 'imported'}")
    assert code == 0, err
    assert (tmp_path / "imported/checkpoints/last.ckpt").is_file()
    assert SECRET not in out + err and holds_secret(tmp_path) == []


@pytest.mark.parametrize("verb_args, key", S3_OPTIONS, ids=[f"{v.split()[0]}-{k}" for v, k in S3_OPTIONS])
def test_no_credentials_or_no_bucket_is_one_line_before_anything_is_written(
    s3, tmp_path, monkeypatch, capsys, verb_args, key
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GPTKIT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "corpus.txt").write_text("hello world\n" * 50)
    # a bucket that does not exist
    code, _, err = run_main(capsys, *verb_args.split(), f"{key}=s3://no-such-bucket-{s3.bucket[7:]}/x")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: {key}=s3://no-such-bucket-") and "does not exist" in err, err
    # no credentials (none in the environment, no shared file)
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    code, _, err = run_main(capsys, *verb_args.split(), f"{key}={s3.url}/x")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: {key}={s3.url}/x: no S3 credentials; set AWS_ACCESS_KEY_ID"), err
    assert sorted(os.listdir(tmp_path)) == ["corpus.txt"]


def test_nothing_complete_there_or_no_s3fs_is_one_line(s3, tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(capsys, "train", f"resume={s3.url}/runs/none")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: resume={s3.url}/runs/none: no complete checkpoint there"), err
    code, _, err = run_main(capsys, "sample", f"run={s3.url}")
    assert code == 2 and err.count("\n") == 1 and "names a bucket; give the run's folder" in err, err
    # the s3 extra missing
    monkeypatch.setitem(sys.modules, "s3fs", None)
    code, _, err = run_main(capsys, "train", f"runs_dir={s3.url}/runs")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: runs_dir={s3.url}/runs needs s3fs, which cannot be imported"), err
    assert err.rstrip().endswith("pip install 'gptkit[s3]'"), err
    assert os.listdir(tmp_path) == []


def test_a_reader_takes_only_complete_folders_whose_files_match(s3, tmp_path, capsys):
    fs = remote.filesystem(s3.url, "runs_dir")
    run = f"{s3.url}/runs/hand"
    for step in (1, 2, 3):
        f = tmp_path / f"step-{step:06d}.ckpt"
        f.write_bytes(f"weights of step {step}".encode())
        folder = f"{run}/checkpoints/step-{step:06d}"
        remote.upload(fs, [(f.name, f)], folder)
    fs.pipe_file(f"{run}/config.yaml", b"model: {}\n")
    # step 3 never finished (no COMPLETE); step 2's file in the bucket is damaged after its upload
    fs.rm(f"{run}/checkpoints/step-000003/COMPLETE")
    fs.pipe_file(f"{run}/checkpoints/step-000002/step-000002.ckpt", b"weights of step X")
    local = remote.fetch_run(run)
    err = capsys.readouterr().err
    assert "step-000002.ckpt does not match its manifest" in err and err.count("\n") == 1, err
    assert (local / "checkpoints/last.ckpt").read_bytes() == b"weights of step 1"
    assert not (local / "checkpoints/step-000002.ckpt").exists()
    assert (local / "config.yaml").read_bytes() == b"model: {}\n"

    # a published data folder whose shard was damaged: one line, exit 2, before training
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.bin").write_bytes(b"\0" * 64)
    assert remote.publish_folder(data, f"{s3.url}/cache/d") is True
    assert remote.publish_folder(data, f"{s3.url}/cache/d") is False
    fs.pipe_file(f"{s3.url}/cache/d/train.bin", b"\1" * 64)
    code, _, err = run_main(capsys, "train", "data=prepared", f"data.dir={s3.url}/cache/d")
    assert code == 2 and err.count("\n") == 1, err
    assert f"{s3.url}/cache/d/train.bin does not match its manifest" in err, err
    # a folder without COMPLETE is never read
    fs.rm(f"{s3.url}/cache/d/COMPLETE")
    with pytest.raises(GptkitError, match=r"no complete folder there"):
        remote.fetch_folder(f"{s3.url}/cache/d", "data.dir")


@pytest.mark.long
def test_kill_9_during_an_upload_loses_nothing_and_resume_takes_the_last_complete_one(s3, corpus, tmp_path):
    args = tiny_run(corpus, f"{s3.url}/runs", "k", steps=6)
    # the second upload (step 6's) killed after its checkpoint file, before its manifest and COMPLETE
    r = run_cli("train", *args, env={**s3.env, "GPTKIT_FAULT": "remote-upload@2"})
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert complete(s3, "runs/k") == ["step-000003"]
    assert "runs/k/checkpoints/step-000006/step-000006.ckpt" in keys(s3)
    # another node resumes from the bucket: step 3, to step 6, every row once
    node2 = tmp_path / "node2"
    r = run_cli("train", f"resume={s3.url}/runs/k", env={**s3.env, "GPTKIT_CACHE": str(node2)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert complete(s3, "runs/k") == ["step-000003", "step-000006"]
    assert metric_steps(body(s3, "runs/k/metrics.csv")) == [1, 2, 3, 4, 5, 6]
    assert SECRET not in r.stdout + r.stderr and holds_secret(tmp_path) == []
