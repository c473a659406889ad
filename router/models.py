"""`Routers`: the front door's routers, one per served model, looked up by the request's
`model`.

Each model has a `Router` of its own over a backend of its own (its own workers, KV pools
and prefix caches), with its own tokenizer, chat template, admission queue and metrics.
Both servers pick the router by the request's `model` field; one registry serves every
model's series at `/metrics`, told apart by their `model_name` label.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from router.errors import InvalidRequestError, ModelNotFoundError, RequestNotFoundError
from router.router import Router


class Routers:
    """The served models' routers, by served name (the first is the default).

    Args:
        routers: one per model; their `model_info.name`s must differ.

    Raises:
        ValueError: no router, or two serving the same name.
    """

    def __init__(self, routers: list[Router]) -> None:
        if not routers:
            raise ValueError("serve at least one model")
        self.by_name: dict[str, Router] = {}
        for router in routers:
            name = router.model_info.name
            if name in self.by_name:
                raise ValueError(f"served-model-name: {name!r} is served twice")
            self.by_name[name] = router
        self.default = routers[0]
        self.registry = CollectorRegistry()
        self.registry.register(_Merged([r.metrics.registry for r in routers]))

    def __iter__(self) -> Iterator[Router]:
        return iter(self.by_name.values())

    def __len__(self) -> int:
        return len(self.by_name)

    def get(self, model: str | None) -> Router:
        """The router of `model`; with one model served, also for None or "".

        Raises:
            ModelNotFoundError: no model of that name is served (the message names it and
                the served ones).
            InvalidRequestError: no model named while several are served.
        """
        if len(self.by_name) == 1:
            self.default.check_model(model)  # counted in its rejections
            return self.default
        if not model:
            raise InvalidRequestError(f"model: required, this server serves several: "
                                      f"{', '.join(self.by_name)}", "model")
        router = self.by_name.get(model)
        if router is None:
            raise ModelNotFoundError(f"model: {model!r} is not served here; the models are "
                                     f"{', '.join(map(repr, self.by_name))}", "model")
        return router

    def holding(self, request_id: str) -> Router:
        """The router running or queueing `request_id`.

        Raises:
            RequestNotFoundError: none is.
        """
        for router in self:
            if router.has(request_id):
                return router
        raise RequestNotFoundError(f"request_id: no queued or running request "
                                   f"{request_id!r}", "request_id")

    def healthy(self) -> bool:
        """True while every model can take requests."""
        return all(router.healthy() for router in self)

    async def drain(self, timeout_s: float) -> int:
        """Drain every model's router at once; how many requests were left running."""
        return sum(await asyncio.gather(*(router.drain(timeout_s) for router in self)))


class _Merged(Collector):
    """Several registries as one: same-named families merged, so each metric appears once
    with one series per `model_name`."""

    def __init__(self, registries: list[CollectorRegistry]) -> None:
        self.registries = registries

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for registry in self.registries:
            for family in registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit)
                merged.samples.extend(family.samples)
        yield from families.values()
