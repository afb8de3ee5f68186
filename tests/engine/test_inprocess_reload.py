"""VLLMInProcessAdapter(install_method="reload") against real in-process tiny vLLM engines (Qwen2, Llama; fp32,
bf16; tied)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import hotweights
from hotweights import (
    NonFiniteWeightsError,
    StaleWeightVersionError,
    WeightManifestValidationError,
    WeightUpdateManifest,
)
from hotweights.adapters import VLLMInProcessAdapter
from hotweights.testing import build_tiny_model
from hotweights.vllm.worker import ops as worker_ops
from hotweights.vllm.worker.ops import reload_checkpoint_tensors

from ..conftest import poisoned, refused_as
from .conftest import PROMPTS, TinyCheckpoint, Variant, greedy_vllm, start_engine, stop_engine

pytestmark = pytest.mark.engine

VARIANTS = [
    Variant("qwen2", torch.float32, tie=False),
    Variant("llama", torch.float32, tie=True),
    Variant("qwen2", torch.bfloat16, tie=True),
]


class Engine:
    """One running engine plus its checkpoints A (started from) and B."""

    def __init__(self, llm: Any, a: TinyCheckpoint, b: TinyCheckpoint, versions: Iterator[int]) -> None:
        self.llm, self.a, self.b = llm, a, b
        self.adapter = VLLMInProcessAdapter(llm, install_method="reload")
        self._versions = versions

    def version(self) -> int:
        return next(self._versions)

    def install(self, ckpt: TinyCheckpoint) -> hotweights.InstallReport:
        sd = ckpt.state_dict()
        return self.adapter.install(WeightUpdateManifest.from_state_dict(sd, weight_version=self.version()), sd)

    def outputs(self) -> list[list[int]]:
        return greedy_vllm(self.llm)


@pytest.fixture(scope="module", params=VARIANTS, ids=lambda v: v.id)
def engine(
    request: pytest.FixtureRequest,
    checkpoint: Callable[[Variant, int], TinyCheckpoint],
    versions: Iterator[int],
) -> Iterator[Engine]:
    variant: Variant = request.param
    a, b = checkpoint(variant, 1), checkpoint(variant, 2)
    assert a.fresh != b.fresh, "seeds must give different outputs, or the tests below prove nothing"
    eng = Engine(start_engine(a.path, dtype=variant.vllm_dtype), a, b, versions)
    yield eng
    stop_engine(eng.llm)


def test_a_to_b_to_a_matches_fresh_engines(engine: Engine) -> None:
    engine.install(engine.a)
    assert engine.outputs() == engine.a.fresh
    engine.install(engine.b)
    assert engine.outputs() == engine.b.fresh
    if engine.b.hf is not None:
        assert engine.outputs() == engine.b.hf
    engine.install(engine.a)
    assert engine.outputs() == engine.a.fresh


def test_report_and_versions(engine: Engine) -> None:
    before = engine.adapter.active_weight_version
    report = engine.install(engine.b)
    v = report.weight_version
    assert report.previous_version == before
    assert engine.adapter.active_weight_version == v
    assert report.engine_weight_version == str(v) == engine.llm.llm_engine.get_weight_version()
    assert report.prefix_cache_reset is True
    sent = {n: t for n, t in engine.b.state_dict().items() if not (engine.b.variant.tie and n == "lm_head.weight")}
    assert report.num_tensors == len(sent)
    assert report.num_bytes == sum(t.nbytes for t in sent.values())
    assert list(report.phases) == [
        "validate",
        "begin",
        "transfer",  # by reference: the tensors are handed over, nothing is copied
        "prepare",
        "wait_generation",
        "install",
        "reset_prefix_cache",
        "record_version",
    ]
    # generation was held off from the gate to its release: the write and what follows, not the staging before it
    assert report.stall_s is not None
    assert report.phases["install"] <= report.stall_s <= report.seconds - report.phases["validate"] + 0.05
    if engine.b.variant.tie:
        assert report.skipped and report.skipped[0].startswith("lm_head.weight")
    else:
        assert report.skipped == ()


def test_stale_version_refused_unless_forced(engine: Engine) -> None:
    engine.install(engine.a)
    active = engine.adapter.active_weight_version
    assert active is not None
    sd = engine.b.state_dict()
    with pytest.raises(StaleWeightVersionError, match=f"not newer than the active version {active}"):
        engine.adapter.install(WeightUpdateManifest.from_state_dict(sd, weight_version=active), sd)
    assert engine.outputs() == engine.a.fresh
    report = engine.adapter.install(WeightUpdateManifest.from_state_dict(sd, weight_version=active), sd, force=True)
    assert report.weight_version == active
    assert engine.outputs() == engine.b.fresh


def test_fp32_master_weights_cast_into_a_bf16_engine(engine: Engine) -> None:
    """A trainer's fp32 weights into a bf16 engine: refused naming the opt-in, exact with cast=torch.bfloat16."""
    if engine.b.variant.dtype != torch.bfloat16:
        pytest.skip("the bf16 engine of this module")
    variant = engine.b.variant  # B's bf16 checkpoint is this model cast: build_tiny_model builds in fp32
    master = dict(build_tiny_model(variant.arch, engine.b.seed, tie=variant.tie).state_dict())
    engine.install(engine.a)
    with pytest.raises(WeightManifestValidationError, match='cast="engine"'):
        hotweights.install(engine.llm, master, weight_version=engine.version(), adapter=engine.adapter)
    assert engine.outputs() == engine.a.fresh  # nothing was written
    report = hotweights.install(
        engine.llm, master, weight_version=engine.version(), adapter=engine.adapter, cast=torch.bfloat16
    )
    assert report.cast_tensors == len(master) - 1  # every floating tensor but the tied head (skipped)
    assert engine.outputs() == engine.b.fresh  # a fresh bf16 engine on B (B's bf16 checkpoint is B.to(bf16))
    engine.install(engine.a)
    assert engine.outputs() == engine.a.fresh


def _bad_updates(
    sd: dict[str, torch.Tensor],
) -> dict[str, tuple[dict[str, torch.Tensor], set[tuple[str, str]]]]:
    """Each bad update and the (kind, name) mismatches it must be refused with."""
    norm, emb = "model.norm.weight", "model.embed_tokens.weight"
    q = "model.layers.0.self_attn.q_proj.weight"
    other = torch.float16 if sd[q].dtype != torch.float16 else torch.float32
    missing = {k: v for k, v in sd.items() if k != norm}
    shape = {**sd, q: sd[q][:-1]}
    dtype = {**sd, q: sd[q].to(other)}
    extra = {**sd, "model.layers.9.mlp.up_proj.weight": torch.zeros(4, 4, dtype=sd[q].dtype)}
    everything = {**missing, q: sd[q][:-1], emb: sd[emb].to(other), "bogus.weight": torch.zeros(3)}
    return {
        "missing": (missing, {("missing", norm)}),
        "shape": (shape, {("shape", q)}),
        "dtype": (dtype, {("dtype", q)}),
        "extra": (extra, {("unexpected", "model.layers.9.mlp.up_proj.weight")}),
        "all-at-once": (
            everything,
            {("missing", norm), ("shape", q), ("dtype", emb), ("unexpected", "bogus.weight")},
        ),
    }


def test_bad_updates_write_nothing(engine: Engine) -> None:
    engine.install(engine.a)
    version = engine.adapter.active_weight_version
    engine_version = engine.llm.llm_engine.get_weight_version()
    for label, (tensors, want) in _bad_updates(engine.b.state_dict()).items():
        with pytest.raises(WeightManifestValidationError) as info:
            hotweights_install = engine.adapter.install
            hotweights_install(WeightUpdateManifest.from_state_dict(tensors, weight_version=engine.version()), tensors)
        got = {(m.kind, m.name) for m in info.value.mismatches}
        assert got == want, label
        for _, name in want:
            assert name in str(info.value)
        assert engine.outputs() == engine.a.fresh, f"{label}: outputs changed after a refused update"
        assert engine.adapter.active_weight_version == version
        assert engine.llm.llm_engine.get_weight_version() == engine_version


def test_tensors_not_matching_their_manifest_are_refused(engine: Engine) -> None:
    engine.install(engine.a)
    sd = engine.b.state_dict()
    manifest = WeightUpdateManifest.from_state_dict(sd, weight_version=engine.version())
    q = "model.layers.1.self_attn.q_proj.weight"
    with pytest.raises(WeightManifestValidationError, match=q):
        engine.adapter.install(manifest, {**sd, q: sd[q].t().contiguous()[:, :-1]})
    assert engine.outputs() == engine.a.fresh


def test_prefix_cache_reset_prevents_stale_output(engine: Engine) -> None:
    long_prompt = [PROMPTS[-1]]
    engine.install(engine.a)
    a_long = greedy_vllm(engine.llm, long_prompt)  # fills the prefix cache with A's KV blocks
    b_long = [engine.b.fresh[-1]]
    assert a_long == [engine.a.fresh[-1]] != b_long

    # Control: with the cache kept, vLLM serves A's cached blocks to B's weights -> not B's output.
    keep = VLLMInProcessAdapter(engine.llm, install_method="reload", prefix_cache="keep")
    sd = engine.b.state_dict()
    report = keep.install(WeightUpdateManifest.from_state_dict(sd, weight_version=engine.version()), sd)
    assert report.prefix_cache_reset is False
    assert greedy_vllm(engine.llm, long_prompt) != b_long, "control failed: stale cache not observable"

    # The default policy resets: B's output exactly.
    engine.install(engine.a)
    assert greedy_vllm(engine.llm, long_prompt) == a_long
    engine.install(engine.b)
    assert greedy_vllm(engine.llm, long_prompt) == b_long


def test_one_call_install(engine: Engine) -> None:
    # the fixture adapter and hotweights.install's own share the engine's version line
    v = engine.version()
    report = hotweights.install(engine.llm, engine.b.state_dict(), weight_version=v)
    assert report.adapter == "inprocess-auto"
    assert engine.outputs() == engine.b.fresh
    with pytest.raises(StaleWeightVersionError):
        hotweights.install(engine.llm, engine.a.state_dict(), weight_version=v)
    assert engine.outputs() == engine.b.fresh
    assert hotweights.adapter_for(engine.llm).active_weight_version == v


def test_install_never_overlaps_generation(engine: Engine) -> None:
    """Rollouts loop in another thread while installs alternate A/B: every response is wholly A's or B's."""
    engine.install(engine.a)
    stop = threading.Event()
    results: list[list[list[int]]] = []
    errors: list[BaseException] = []

    def rollouts() -> None:
        while not stop.is_set():
            try:
                results.append(greedy_vllm(engine.llm))
            except BaseException as exc:
                errors.append(exc)
                return

    worker = threading.Thread(target=rollouts)
    worker.start()
    try:
        for i in range(6):
            while len(results) < 2 * i + 1 and not errors:  # let rollouts run between installs
                time.sleep(0.01)
            engine.install(engine.b if i % 2 == 0 else engine.a)
    finally:
        stop.set()
        worker.join(120)
    assert not errors, errors
    assert {"a" if r == engine.a.fresh else "b" if r == engine.b.fresh else "mixed" for r in results} == {"a", "b"}


def test_failure_after_a_partial_write_clears_kv_cache_and_next_install_heals(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reload that dies after writing half a layer (q without k/v: uninitialised shards, NaN-prone): the error
    says so, the KV cache is zeroed and the prefix cache reset, and the next full install serves B exactly."""
    engine.install(engine.a)
    greedy_vllm(engine.llm)  # fill KV blocks

    def dies_halfway(worker: Any, items: Any) -> int:
        reload_checkpoint_tensors(worker, [(n, t) for n, t in items if ".k_proj." not in n and ".v_proj." not in n])
        raise RuntimeError("worker died after writing some layers")

    monkeypatch.setattr(worker_ops, "reload_checkpoint_tensors", dies_halfway)
    version = engine.adapter.active_weight_version
    with pytest.raises(hotweights.InstallError, match=r"Some layers may hold new weights; .* KV-cache tensors zeroed"):
        engine.install(engine.b)
    assert engine.adapter.active_weight_version == version
    runner = engine.llm.llm_engine.model_executor.driver_worker.worker.model_runner
    assert runner.kv_caches and all(not t.any() for t in runner.kv_caches)  # zeroed, NaNs included
    with pytest.raises(hotweights.PartialUpdateError):  # fails closed until a full install
        greedy_vllm(engine.llm)
    monkeypatch.undo()
    engine.install(engine.b)
    assert greedy_vllm(engine.llm) == engine.b.fresh


def test_reload_that_raises_inside_vllm_leaves_a_usable_model(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tensors stop midway *inside* vLLM's layerwise reload (its layers already on the meta device): the install
    fails closed, and the next full install (a fresh layerwise reload of every layer) serves B exactly."""
    engine.install(engine.a)

    def stops_midway(worker: Any, items: Any) -> int:
        items = list(items)

        def feed() -> Any:
            yield from items[: len(items) // 2]
            raise RuntimeError("the sender died inside the reload")

        return reload_checkpoint_tensors(worker, feed())

    monkeypatch.setattr(worker_ops, "reload_checkpoint_tensors", stops_midway)
    with pytest.raises(hotweights.InstallError, match="the sender died inside the reload"):
        engine.install(engine.b)
    monkeypatch.undo()
    engine.install(engine.b)
    assert greedy_vllm(engine.llm) == engine.b.fresh
    engine.install(engine.a)
    assert greedy_vllm(engine.llm) == engine.a.fresh


def test_nan_and_inf_are_refused_by_reference_before_anything_is_written(engine: Engine) -> None:
    engine.install(engine.a)
    before, version = engine.outputs(), engine.adapter.active_weight_version
    assert before == engine.a.fresh != engine.b.fresh
    sd, named = poisoned(engine.b.state_dict())
    for install in (
        lambda: hotweights.install(engine.llm, sd, weight_version=engine.version()),  # the direct setter, by reference
        lambda: engine.adapter.install(WeightUpdateManifest.from_state_dict(sd, weight_version=engine.version()), sd),
    ):
        with pytest.raises(NonFiniteWeightsError) as info:
            install()
        assert refused_as(info.value) == named  # every bad tensor at once: they are all at hand
    assert engine.adapter.active_weight_version == version
    assert engine.outputs() == before  # not fenced: nothing was written
