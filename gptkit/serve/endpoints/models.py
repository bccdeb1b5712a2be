"""GET /v1/models and GET /v1/models/<id>: the one model served (a 404 for any other id)."""

from __future__ import annotations

from typing import Any, Optional

from gptkit.serve.endpoints.base import Endpoint


class Models(Endpoint):
    path = "/v1/models"
    method = "GET"

    def card(self) -> dict:
        served = self.served
        return {"id": served.name, "object": "model", "created": served.created, "owned_by": "gptkit"}

    def answer(self, body: Optional[dict], path_params: dict[str, Any]) -> dict:
        return {"object": "list", "data": [self.card()]}


class Model(Models):
    path = "/v1/models/{model:path}"

    def answer(self, body: Optional[dict], path_params: dict[str, Any]) -> dict:
        self.check_model(path_params["model"])
        return self.card()
