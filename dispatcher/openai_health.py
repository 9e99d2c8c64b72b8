"""vLLM's probe routes on the front door's HTTP port (LLM mode), for the load balancers and
orchestrators set up for a vLLM server:

- ``GET /health``: 200 with an empty body while every LLM model of the node can be served (a
  registered "gpu" instance, where its decode runs), 503 otherwise or while the dispatcher does
  not answer; vLLM's answers 503 once its engine is dead. ``GET`` and ``POST /ping`` (SageMaker's)
  answer the same.
- ``GET /load``: ``{"server_load": n}``, the completions (``/v1/completions`` and chat) this
  front-door process is serving now, as vLLM's API server counts its own.
- ``GET /version``: ``{"version": ...}``, as vLLM's (Batchyard's version: clients that log it or
  check it is there got a 404).
"""

from __future__ import annotations

from aiohttp import web

from . import __version__


class OpenAiHealth:
    def __init__(self, core, completions):
        self.core, self.completions = core, completions

    def routes(self) -> list:
        return [web.get("/health", self.health, allow_head=False), web.get("/ping", self.health, allow_head=False),
                web.post("/ping", self.health), web.get("/load", self.load, allow_head=False),
                web.get("/version", self.version, allow_head=False)]

    async def health(self, request) -> web.Response:
        ready = await self.core.ready_models()  # (None: the dispatcher did not answer)
        return web.Response(status=200 if ready is not None and self.completions.models.keys() <= ready else 503)

    async def load(self, request) -> web.Response:
        return web.json_response({"server_load": self.completions.in_flight})

    async def version(self, request) -> web.Response:
        return web.json_response({"version": __version__})
