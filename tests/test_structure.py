"""One fact, one place: the tables every part of gptkit reads, imported from where they live."""

import pytest
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
