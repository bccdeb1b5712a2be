"""The launch recipes of docs/recipes/ (docs/distributed.md, "Recipes"), checked without their engines: the
Dockerfile by what must hold in it (hadolint itself runs in .ci/recipes), the PyTorchJob manifest against its
CRD's schema (the Kubeflow Training Operator v1.9.0's, vendored), the SkyPilot task by its torchrun line. The
runs (SkyPilot's schema loader, the run: block and the PET_* contract on two loopback nodes) are
.ci/recipes'."""

import copy
import gzip
import json
import re
import shlex

import jsonschema
import yaml
from conftest import REPO

RECIPES = REPO / "docs" / "recipes"
SCHEMA = RECIPES / "schemas" / "kubeflow.org_pytorchjobs-v1.9.0.json.gz"


def readme_torch() -> str:
    """The torch version the README's install command pins."""
    (version,) = set(re.findall(r"torch==([0-9.]+)", (REPO / "README.md").read_text()))
    return version


def instructions(dockerfile) -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in dockerfile.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        word, _, rest = pending.strip().partition(" ")
        out.append((word.upper(), " ".join(rest.split())))
        pending = ""
    return out


def test_the_dockerfile_picks_torchs_cuda_build_by_its_argument_and_runs_gptkit_unprivileged():
    steps = instructions(RECIPES / "Dockerfile")
    args = dict(a.split("=", 1) for w, a in steps if w == "ARG")
    # torch as the README pins it, from the wheel index the build argument names
    assert args["TORCH_VERSION"] == readme_torch() and args["TORCH_CUDA"] == "cu128"
    runs = [a for w, a in steps if w == "RUN"]
    assert any(
        '--index-url "https://download.pytorch.org/whl/${TORCH_CUDA}" "torch==${TORCH_VERSION}"' in r
        for r in runs
    ), runs
    # every pip install pins what it names (or installs this checkout)
    for r in runs:
        for cmd in r.split("&&"):
            words = shlex.split(cmd)
            if words[:2] == ["pip", "install"]:
                named = [w for w in words[2:] if not w.startswith("-") and not w.startswith("https://")]
                assert all(w == "." or "==" in w for w in named), cmd
    # a base image of an exact release
    (base,) = [a for w, a in steps if w == "FROM"]
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+", base), base
    # what `pip install .` needs of the checkout is copied, and each copied path exists
    copied = [src for w, a in steps if w == "COPY" for src in a.split()[:-1]]
    assert all((REPO / c).exists() for c in copied), copied
    toml = (REPO / "pyproject.toml").read_text()
    roots = {v.split("/")[0] for v in re.findall(r'"gptkit\w*" = "([^"]+)"', toml)}
    assert roots == {"gptkit", "conf", "kernels"} and roots | {"pyproject.toml", "README.md"} <= set(copied)
    # not root at the end, and the image is the gptkit command
    users = [a for w, a in steps if w == "USER"]
    assert users and users[-1].split(":")[0].isdigit() and users[-1].split(":")[0] != "0", users
    assert [a for w, a in steps if w == "ENTRYPOINT"] == ['["gptkit"]']


def strict(schema):
    """The CRD's schema as the API server applies it under fieldValidation=Strict: an unknown field is an
    error where the schema lists the fields (and keeps no unknown ones)."""
    if isinstance(schema, dict):
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        for v in schema.values():
            strict(v)
    elif isinstance(schema, list):
        for v in schema:
            strict(v)
    return schema


def test_the_pytorchjob_manifest_is_valid_for_the_crd_and_gives_torchrun_its_world_by_pet_variables():
    validator = jsonschema.Draft7Validator(strict(json.loads(gzip.decompress(SCHEMA.read_bytes()))))
    job = yaml.safe_load((RECIPES / "pytorchjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert [e.message for e in validator.iter_errors(job)] == []
    # the schema can refuse: a misspelled field, a wrong type
    typo = copy.deepcopy(job)
    typo["spec"]["pytorchReplicaSpecs"]["Worker"]["replica"] = 1
    assert ["Additional properties are not allowed ('replica' was unexpected)"] == [
        e.message for e in validator.iter_errors(typo)
    ]
    wrong = copy.deepcopy(job)
    wrong["spec"]["nprocPerNode"] = 8
    assert any("is not of type 'string'" in e.message for e in validator.iter_errors(wrong))
    # the operator's contract: its container is named pytorch, torchrun's world comes from PET_* (no option
    # of the command sets it), and gptkit's world equals it
    spec = job["spec"]
    pods = sum(r["replicas"] for r in spec["pytorchReplicaSpecs"].values())
    for replica in spec["pytorchReplicaSpecs"].values():
        (container,) = replica["template"]["spec"]["containers"]
        assert container["name"] == "pytorch"
        assert container["command"] == ["torchrun", "-m", "gptkit", "train"]
        assert not any(a.startswith("--") for a in container["args"])
        assert f"trainer.devices={spec['nprocPerNode']}" in container["args"]
        assert f"trainer.num_nodes={pods}" in container["args"]


def test_the_skypilot_task_runs_the_torchrun_line_on_skypilots_variables():
    task = yaml.safe_load((RECIPES / "skypilot.yaml").read_text())
    run = " ".join(task["run"].replace("\\\n", " ").split())
    for option in (
        '--nnodes="$SKYPILOT_NUM_NODES"',
        '--nproc-per-node="$SKYPILOT_NUM_GPUS_PER_NODE"',
        '--rdzv-backend=c10d --rdzv-endpoint="$HEAD_NODE:$RDZV_PORT"',
        '--node-rank="$SKYPILOT_NODE_RANK"',
        'trainer.devices="$SKYPILOT_NUM_GPUS_PER_NODE" trainer.num_nodes="$SKYPILOT_NUM_NODES"',
    ):
        assert option in run, option
    assert "torchrun " in run and "-m gptkit train" in run
    assert f"torch=={readme_torch()}" in task["setup"]
