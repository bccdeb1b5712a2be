"""One fact, one place: the tables every part of gptkit reads, imported from where they live."""

import re

import pytest
from conftest import REPO
from omegaconf import OmegaConf

from gptkit.errors import ConfigError, GptkitError
from gptkit.precision import PRECISIONS, precision, torch_dtype


@pytest.mark.parametrize("name", list(PRECISIONS))
def test_every_precision_train_accepts_is_known_to_accounting_and_preflight(name):
    from gptkit.accounting import training_memory
    from gptkit.model import ModelConfig

    # what train and preflight both call
    from gptkit.training.trainer import check_trainer_config

    t = OmegaConf.load("conf/trainer/default.yaml")
    t.precision = name
    check_trainer_config(t)
    mem = training_memory(ModelConfig(n_layers=2, d_model=64, n_heads=2, vocab_size=100), name)
    assert mem["total"] > 0


def test_unknown_precision_and_dtype_are_one_line():
    with pytest.raises(ConfigError, match="trainer.precision='fp8' is not one of 32-true"):
        precision("fp8")
    with pytest.raises(ConfigError, match="dtype='int8' is not one of fp32, bf16, fp16"):
        torch_dtype("int8")
    assert str(torch_dtype("bfloat16")) == "torch.bfloat16"


def test_the_attention_backends_are_the_configs_names():
    from gptkit.model.attention import ATTENTION_BACKENDS
    from gptkit.model.config import ATTENTIONS

    assert tuple(ATTENTION_BACKENDS) == ATTENTIONS


def test_resume_and_init_from_share_one_model_policy():
    from gptkit.options import parse_options
    from gptkit.training.start import FREE_MODEL_KEYS, model_from_source

    saved = {"name": "a", "n_layers": 2, "dropout": 0.0, "attention": "sdpa"}
    asked = OmegaConf.create({"name": "b", "n_layers": 4, "dropout": 0.1, "attention": "eager"})
    got = model_from_source(
        "resume=x", saved, asked, parse_options(["model.dropout=0.1", "model.attention=eager", "optim.lr=1"])
    )
    assert got == {"name": "a", "n_layers": 2, "dropout": 0.1, "attention": "eager"}
    assert set(FREE_MODEL_KEYS) == {"name", "dropout", "attention", "kernels", "position_reset"}
    with pytest.raises(GptkitError, match="init_from=x fixes model.n_layers=2"):
        model_from_source("init_from=x", saved, asked, parse_options(["model.n_layers=4"]))
    with pytest.raises(GptkitError, match="brings its own model"):
        model_from_source("resume=x", saved, asked, parse_options(["model=llama-tiny"]))


@pytest.mark.parametrize(
    "n, seq_len, stride, expected",
    [
        # targets 1-4, 5-8 and the tail 9: every target once
        (10, 4, 4, [0, 4, 8]),
        (10, 4, 2, [0, 2, 4, 6]),
        (5, 8, 8, [0]),
    ],
)
def test_eval_windows_come_from_one_function(n, seq_len, stride, expected):
    from gptkit.evaluation import window_starts

    assert window_starts(n, seq_len, stride) == expected
    assert window_starts(n, seq_len, stride, max_windows=1) == expected[:1]


def test_no_module_imports_itself_around_a_loop():
    """No circle of imports anywhere in gptkit, inside a folder too, counting the imports inside functions
    (grimp reads every import statement): the strongly connected parts of the import graph are single
    modules."""
    import grimp

    graph = grimp.build_graph("gptkit", cache_dir=None)
    modules = sorted(graph.modules)
    edges = {m: sorted(set(graph.find_modules_directly_imported_by(m)) & set(modules)) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    # Tarjan's strongly connected components
    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while not part or part[-1] != v:
                part.append(stack.pop())
            if len(part) > 1:
                circles.append(sorted(part))

    for m in modules:
        if m not in index:
            visit(m)
    assert circles == []


# ---- the maps: tests/README.md, the suite time, docs/training.md's config groups, the links between pages
TESTS = REPO / "tests"


def table_rows(text: str) -> list[list[str]]:
    """The cells of every row of the Markdown tables in `text` (header and separator rows included)."""
    return [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("|")
    ]


def test_every_test_file_is_on_the_map_once():
    """tests/README.md names every Python file under tests/ (by its path under tests/, so that the map takes
    folders) in the last column of its table, each once, and names no file that is not there."""
    named = [
        name
        for row in table_rows((TESTS / "README.md").read_text())
        for name in re.findall(r"`((?:[\w.-]+/)*[\w-]+\.py)`", row[-1])
    ]
    files = sorted(
        p.relative_to(TESTS).as_posix() for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts
    )
    assert sorted(set(files) - set(named)) == [], "files under tests/ that tests/README.md's map leaves out"
    assert sorted(set(named) - set(files)) == [], (
        "names on tests/README.md's map that are not files under tests/"
    )
    assert sorted(n for n in set(named) if named.count(n) > 1) == [], "files named in more than one room"


def test_no_test_file_imports_another():
    """A helper two files share lives in conftest.py: a test file that imports another breaks when either
    moves room (the rank scripts of a 2-process check are imported by their own test file, beside it)."""
    names = {p.stem for p in TESTS.rglob("*.py")} - {"conftest"}
    imports = []
    for f in sorted(TESTS.rglob("test_*.py")):
        for m in re.finditer(r"^\s*(?:from|import) (\w+)", f.read_text(), re.M):
            if m.group(1).startswith("test_") and m.group(1) in names:
                imports.append(f"{f.relative_to(TESTS)} imports {m.group(1)}")
    assert imports == []


def test_every_cited_test_file_exists():
    """A page, a docstring or a CI script that cites `tests/<path>.py` names a file that is there (the
    test files moved into rooms once; a stale path sends a reader nowhere)."""
    cited = set()
    for f in [REPO / "README.md", *REPO.glob("docs/*.md"), *REPO.glob("gptkit/**/*.py"), *REPO.glob(".ci/*")]:
        if f.is_file():
            cited |= {
                (f.relative_to(REPO).as_posix(), c) for c in re.findall(r"\btests/[\w/]+\.py", f.read_text())
            }
    missing = [f"{where}: {c}" for where, c in sorted(cited) if not (REPO / c).is_file()]
    # the README's feature table names its test files by their path under tests/ (a glob for a family)
    for row in table_rows((REPO / "README.md").read_text()):
        if len(row) == 3 and row[2].startswith("`"):
            for c in re.findall(r"`([\w/*]+\.py)`", row[2]):
                if not list(TESTS.glob(c)):
                    missing.append(f"README.md's feature table: {c}")
    assert missing == []


def suite_time(text: str) -> list[tuple[int, int]]:
    """Every duration in minutes a page states, as (minutes, seconds): `7 min 10 s`, `about 3 minutes`."""
    return [(int(m), int(s or 0)) for m, s in re.findall(r"(\d+) min(?:utes?)?\b(?: (\d+) s\b)?", text)]


def test_the_readme_and_the_test_map_give_the_same_suite_time():
    front, tests = suite_time((REPO / "README.md").read_text()), suite_time((TESTS / "README.md").read_text())
    assert front, "README.md states no suite time (write it as: 7 min 10 s to 8 min 17 s on 2 cores)"
    assert front == tests, f"README.md says {front}, tests/README.md {tests}: state the same measured range"


def test_the_config_group_table_lists_every_preset():
    """docs/training.md's table of config groups names every preset of each group `gptkit train` composes
    (conf/<group>/*.yaml), and none that is not there."""
    text = (REPO / "docs" / "training.md").read_text().split("## Config groups", 1)[1].split("\n## ", 1)[0]
    table = {row[0].strip("`"): set(re.findall(r"`([\w.-]+)`", row[1])) for row in table_rows(text)[2:]}
    defaults = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "train.yaml"))["defaults"]
    # model: gpt2-tiny, optional experiment: null (not _self_, not override hydra/...)
    groups = sorted(
        next(iter(d)).split()[-1] for d in defaults if isinstance(d, dict) and "/" not in next(iter(d))
    )
    assert sorted(table) == groups
    for group in groups:
        presets = {p.stem for p in (REPO / "conf" / group).glob("*.yaml")}
        assert table[group] == presets, f"docs/training.md's `{group}` row: {sorted(presets ^ table[group])}"


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown page (lower case, punctuation dropped, spaces as
    hyphens, -1, -2, ... for repeats), code blocks left out."""
    anchors: list[str] = []
    for line in re.sub(r"^```.*?^```", "", text, flags=re.M | re.S).splitlines():
        m = re.match(r"#{1,6} (.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = sum(a == slug or re.fullmatch(re.escape(slug) + r"-\d+", a) is not None for a in anchors)
            anchors.append(f"{slug}-{n}" if n else slug)
    return set(anchors)


def test_the_links_between_pages_resolve():
    """Every relative link of the README, tests/README.md and docs/ names a file that exists and, with
    #anchor, a heading of that page."""
    pages = [REPO / "README.md", TESTS / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest.read_text()):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert broken == []


def test_the_docs_index_lists_every_page_once():
    """docs/README.md is the one index: the first cell of its tables links every page of docs/, each once,
    and the README's "Read on" points to it."""
    index = REPO / "docs" / "README.md"
    listed = [
        target.split("#", 1)[0]
        for row in table_rows(index.read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", row[0])
    ]
    pages = sorted(p.name for p in (REPO / "docs").glob("*.md") if p != index)
    assert sorted(set(pages) - set(listed)) == [], "pages of docs/ that docs/README.md does not list"
    assert sorted(set(listed) - set(pages)) == [], "entries of docs/README.md that are not pages of docs/"
    assert sorted(p for p in set(listed) if listed.count(p) > 1) == [], "pages docs/README.md lists twice"
    read_on = (REPO / "README.md").read_text().split("## Read on", 1)[1].split("\n## ", 1)[0]
    assert "(docs/README.md)" in read_on, "the README's Read on does not point to docs/README.md"


def test_the_layout_names_every_room():
    """docs/layout.md's rooms block names every module and package of gptkit/ (as gptkit/<name>) and every
    module of gptkit/training/ and gptkit/data/."""
    text = (REPO / "docs" / "layout.md").read_text()
    rooms = text.split("Rooms, top to bottom", 1)[1].split("### Adding", 1)[0]
    pkg = REPO / "gptkit"
    top = [
        f"gptkit/{p.name}"
        for p in sorted(pkg.iterdir())
        if (p.suffix == ".py" and not p.name.startswith("__")) or (p / "__init__.py").is_file()
    ]
    assert [name for name in top if name not in rooms] == [], "rooms docs/layout.md does not name"
    inner = [
        p.name
        for folder in ("training", "data")
        for p in sorted((pkg / folder).iterdir())
        if (p.suffix == ".py" and not p.name.startswith("__")) or (p / "__init__.py").is_file()
    ]
    assert [name for name in inner if name not in rooms] == [], "modules docs/layout.md does not name"


def test_the_wheel_lists_every_package_and_the_files_they_read():
    """pyproject.toml names the packages a wheel installs one by one: a new package missing there is missing
    from every installed gptkit (gptkit.training.objectives was, until the QLoRA merge found it)."""
    import tomllib

    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    found = {
        ".".join(p.parent.relative_to(REPO).parts)
        for p in (REPO / "gptkit").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert found - listed == set(), "packages missing from pyproject.toml's [tool.setuptools] packages"
    # every other file a package holds (the chat page, the built-in corpus) is its package data
    data = tool["package-data"]
    for f in (REPO / "gptkit").rglob("*"):
        if f.is_dir() or f.suffix in (".py", ".pyc") or "__pycache__" in f.parts:
            continue
        pkg_dir = next(d for d in f.parents if (d / "__init__.py").is_file())
        pkg = ".".join(pkg_dir.relative_to(REPO).parts)
        rel = f.relative_to(pkg_dir)
        assert any(rel.match(g) for g in data.get(pkg, [])), (
            f"{f.relative_to(REPO)} is not package data of {pkg}"
        )


def test_the_kernels_folder_never_shadows_an_installed_kernels_package():
    """From the repository root (`python -m gptkit`, as the tests and a user in a clone run it),
    `import kernels` is Hugging Face's `kernels` package, which transformers imports: kernels/ has no
    __init__.py, and an installed regular package wins over a folder without one. Ours is gptkit_kernels."""
    import importlib.metadata
    import subprocess
    import sys

    assert not (REPO / "kernels" / "__init__.py").exists()
    probe = (
        "import kernels, gptkit_kernels, pathlib; "
        "print(getattr(kernels, '__file__', None)); print(list(kernels.__path__)); "
        "print(pathlib.Path(gptkit_kernels.__file__).parent)"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    kernels_file, kernels_path, ours = out.stdout.splitlines()
    assert ours == str(REPO / "kernels" / "gptkit_kernels") or "site-packages" in ours, ours
    try:
        installed = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        # nothing installed under that name: the folder is an empty namespace, never our kernels
        assert kernels_file == "None", kernels_file
    else:
        assert kernels_file != "None" and str(REPO / "kernels") not in kernels_file, kernels_file
        assert str(installed.locate_file("kernels")) in kernels_file, (kernels_file, kernels_path)
