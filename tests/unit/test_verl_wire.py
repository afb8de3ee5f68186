"""hotweights.integrations.verl without verl: what its wire admits, and what it says where verl is missing.

The real sync (verl's sender into a real engine) is tests/integrations/test_verl.py, run by ``make test-verl``.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import torch

from hotweights.core.errors import InstallError
from hotweights.integrations import verl


def test_verls_messages_are_read() -> None:
    message = {
        "bucket_meta": {"w": {"name": "w", "shape": torch.Size([2, 3]), "dtype": torch.bfloat16, "offset": 64}},
        "is_last": True,
    }
    assert verl._loads(pickle.dumps(message)) == message
    assert verl._entries(message) == ([("w", torch.Size([2, 3]), torch.bfloat16, 64)], [])


def test_a_message_naming_anything_else_is_refused() -> None:
    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, ("true",))

    with pytest.raises(InstallError, match=r"posix\.system|os\.system"):
        verl._loads(pickle.dumps({"bucket_meta": {}, "is_last": Evil()}))


def test_a_bucket_without_torch_types_is_refused() -> None:
    with pytest.raises(InstallError, match=r"torch\.Size shape"):
        verl._entries({"bucket_meta": {"w": {"shape": [2, 3], "dtype": torch.float32, "offset": 0}}})


def test_the_verl_transport_opens_only_this_workers_buckets() -> None:
    buffer = torch.zeros(8, dtype=torch.uint8)
    assert verl.Receiver.open(verl.Receiver.parse({"transport": "verl", "nbytes": 8, "buffer": buffer}))[0] is buffer
    with pytest.raises(ValueError, match="cannot come from elsewhere"):
        verl.Receiver.parse({"transport": "verl", "nbytes": 8, "buffer": [0] * 8})


def test_shm_names_other_than_verls_are_refused() -> None:
    with pytest.raises(InstallError, match="verl_weights_"):
        verl._Buffer({"name": "../etc/passwd", "size": 8}, use_shm=True, device=None)


def test_timeout_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(verl.TIMEOUT_ENV, "2.5")
    assert verl._timeout() == 2.5
    monkeypatch.setenv(verl.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=verl.TIMEOUT_ENV):
        verl._timeout()


def test_importing_it_imports_neither_verl_nor_zmq() -> None:
    code = "import sys, hotweights.integrations.verl; assert not {'verl', 'zmq'} & set(sys.modules), 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_without_verl_the_extension_says_what_to_install() -> None:
    import importlib.util

    if importlib.util.find_spec("verl") is not None:
        pytest.skip("verl is installed here")
    with pytest.raises(ImportError, match=r"install verl"):
        verl.VerlWorkerExtension  # noqa: B018


def test_peft_names_of_base_weights_map_to_the_checkpoints() -> None:
    from hotweights.core.lora import base_name

    assert base_name("model.layers.0.self_attn.q_proj.base_layer.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert (
        base_name("base_model.model.model.layers.1.mlp.down_proj.base_layer.bias")
        == "model.layers.1.mlp.down_proj.bias"
    )
    assert base_name("base_model.model.lm_head.weight") == "lm_head.weight"
    assert base_name("model.norm.weight") == "model.norm.weight"


def test_an_adapter_sync_copies_each_tensor_out_and_refuses_a_repeat_or_an_overrun() -> None:
    from hotweights.core.errors import WeightManifestValidationError
    from hotweights.integrations.verl_update import AdapterUpdate

    buffer = torch.arange(16, dtype=torch.float32).view(torch.uint8)
    update = AdapterUpdate(worker=None, version=1, expected=None, config={})
    update.stage(buffer, [("a.lora_A.weight", torch.Size([2, 2]), torch.float32, 0)])
    buffer.zero_()  # verl's sender rewrites its buffer once answered
    assert update.tensors["a.lora_A.weight"].tolist() == [[0.0, 1.0], [2.0, 3.0]]
    with pytest.raises(WeightManifestValidationError, match="sent twice") as info:
        update.stage(buffer, [("a.lora_A.weight", torch.Size([2, 2]), torch.float32, 0)])
    assert [m.name for m in info.value.mismatches] == ["a.lora_A.weight"]
    with pytest.raises(WeightManifestValidationError, match="outside verl's 64-byte buffer"):
        update.stage(buffer, [("b.lora_A.weight", torch.Size([4, 4]), torch.float32, 8)])
    update.abort()
    assert update.tensors == {} and update.commit() == {}  # nothing sent: nothing installed


def test_each_bucket_is_settled_on_its_device_before_it_is_answered(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the copies out of verl's CUDA IPC buffer run asynchronously, and verl's sender rewrites that buffer
    as soon as the bucket is answered: ``Update.stage`` (after which the receiver answers) returns only once the
    copies it issued are done (``settle``, on the buffer's device; a no-op on a CPU, whose copies are done)."""
    import types

    from hotweights.integrations import verl_update

    events: list[str] = []
    pack = verl_update.pack
    monkeypatch.setattr(verl_update, "pack", lambda *a: (events.append("copy"), pack(*a))[1])
    monkeypatch.setattr(verl_update, "settle", lambda device: events.append(f"settle {device.type}"))
    buffer = torch.arange(16, dtype=torch.float32).view(torch.uint8)
    update = verl_update.Update(types.SimpleNamespace(), version=1, expected=None, dtype=torch.bfloat16)
    update.stage(buffer, [("w", torch.Size([2, 2]), torch.float32, 0)])
    update.stage(buffer, [("v", torch.Size([2, 2]), torch.float32, 16)], borrow=True)
    assert events == ["copy", "settle cpu", "copy", "settle cpu"]
    buffer.zero_()  # verl's sender rewrites its buffer once answered
    (_, w), (_, v) = update.pending
    assert w.view(torch.bfloat16).tolist() == [0.0, 1.0, 2.0, 3.0]  # cast to the engine's dtype as copied
    assert v.view(torch.bfloat16).tolist() == [4.0, 5.0, 6.0, 7.0]
    verl_update.settle(torch.device("cpu"))  # nothing to wait for on a CPU


def test_the_worker_side_adapter_checks_name_every_module_its_lora_layers_do_not_take() -> None:
    from types import SimpleNamespace

    from hotweights._lora import checked_adapter
    from hotweights.core.errors import WeightManifestValidationError
    from hotweights.vllm.introspect import worker_lora_modules, worker_lora_rank

    manager = SimpleNamespace(
        supported_lora_modules=["qkv_proj", "o_proj"],
        packed_modules_mapping={"qkv_proj": ["q_proj", "k_proj", "v_proj"]},
    )
    worker = SimpleNamespace(
        model_runner=SimpleNamespace(lora_manager=SimpleNamespace(_adapter_manager=manager)),
        vllm_config=SimpleNamespace(lora_config=SimpleNamespace(max_lora_rank=8)),
    )
    supported = worker_lora_modules(worker)
    assert supported == {"q_proj", "k_proj", "v_proj", "o_proj"} and worker_lora_rank(worker) == 8
    assert worker_lora_rank(SimpleNamespace(vllm_config=SimpleNamespace(lora_config=None))) is None
    tensors = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 16),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(16, 8),
        "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 16),
        "base_model.model.lm_head.lora_B.weight": torch.zeros(32, 8),
    }
    with pytest.raises(
        WeightManifestValidationError, match="LoRA layers do not take; they take k_proj, o_proj, q_proj, v_proj"
    ) as info:
        checked_adapter(tensors, None, 8, name="123", supported=supported)
    assert [(m.kind, m.name) for m in info.value.mismatches] == [("unexpected", "base_model.model.lm_head")]
    del tensors["base_model.model.lm_head.lora_A.weight"], tensors["base_model.model.lm_head.lora_B.weight"]
    items, files = checked_adapter(tensors, None, 8, name="123", config={"r": 8, "lora_alpha": 16}, supported=supported)
    assert len(items) == 2 and files["target_modules"] == ["q_proj"] and files["lora_alpha"] == 16


def test_verls_lora_loader_patch_is_undone_and_nothing_else() -> None:
    worker_manager = pytest.importorskip("vllm.lora.worker_manager")
    cls = worker_manager.LRUCacheWorkerLoRAManager
    assert "_load_adapter" not in vars(cls)

    def hijack__load_adapter(self: object, request: object) -> None:  # what verl's VLLMHijack sets
        raise AssertionError

    hijack__load_adapter.__module__ = "verl.utils.vllm.utils"
    cls._load_adapter = hijack__load_adapter
    try:
        verl._vllms_lora_loader()
        assert "_load_adapter" not in vars(cls)
        assert cls._load_adapter is worker_manager.WorkerLoRAManager._load_adapter  # vLLM's own
        own = worker_manager.WorkerLoRAManager._load_adapter
        cls._load_adapter = own  # anything not verl's stays
        verl._vllms_lora_loader()
        assert vars(cls)["_load_adapter"] is own
    finally:
        if "_load_adapter" in vars(cls):
            delattr(cls, "_load_adapter")
