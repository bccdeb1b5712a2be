"""gptkit: train decoder-only transformer language models (GPT-2 and Llama style).

From Python: `gptkit.train(cfg)` runs one training (see gptkit.training.fit.train); the model alone is
`from gptkit.model import GPT, ModelConfig`.
"""

from gptkit.version import __version__

__all__ = ["__version__", "train"]


def train(cfg, **kwargs):
    """One training run (gptkit.training.fit.train) from a composed `train` config, a dict of one, or a
    list of key=value overrides such as ["model=llama-tiny", "trainer.max_steps=100"]."""
    # imported on call: `import gptkit` (and `gptkit --help`) stays free of torch and Lightning
    from gptkit.training.fit import as_config
    from gptkit.training.fit import train as fit_train

    return fit_train(as_config(cfg), **kwargs)
