"""The endpoints of the OpenAI API that gptkit serve answers: one interface (base.Endpoint), one table.

    POST /v1/chat/completions    chat_completions.py: messages -> the chat template -> the engine
    POST /v1/completions         completions.py: a prompt (text or token ids, one or several) -> the engine
    GET  /v1/models[/<id>]       models.py: the one model served

gptkit/serve/app.py routes each row, guards it (the API key, the body's size and type, errors in OpenAI's
shape) and runs what it answers, and never asks which endpoint it has. A new endpoint is a file here with
its Endpoint subclass, and one row of ENDPOINTS.
"""

from __future__ import annotations

from gptkit.serve.endpoints.base import Endpoint, Generation, Reply
from gptkit.serve.endpoints.chat_completions import ChatCompletions
from gptkit.serve.endpoints.completions import Completions
from gptkit.serve.endpoints.models import Model, Models

ENDPOINTS: tuple[type[Endpoint], ...] = (ChatCompletions, Completions, Models, Model)

__all__ = ["ENDPOINTS", "Endpoint", "Generation", "Reply"]
