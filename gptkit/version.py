"""The version of gptkit, in a leaf module that any room may import (the package face imports training)."""

__version__ = "0.1.0"
