"""A user's own worker extension, a subclass of hotweights' (tests only): what an engine started for another
framework carries (verl's ``VerlWorkerExtension`` is one), with one method of its own."""

from __future__ import annotations

from hotweights.vllm.worker.extension import HotWeightsWorkerExtension

EXTENSION = "tests.engine.own_extension.OwnExtension"


class OwnExtension(HotWeightsWorkerExtension):
    """hotweights' worker extension, and ``own_hello`` (``collective_rpc("own_hello")``)."""

    def own_hello(self) -> str:
        return "hello from a subclass"
