"""`--device`: the best available by default, a named device checked against this machine, the dtype that
goes with it, and a span whose weights, buffers and cache all live on it."""

import pytest
import torch

from corolla.config import EngineConfig, ServerConfig
from corolla.engine.engine import Engine
from corolla.errors import InvalidRequest
from corolla.models import devices
from corolla.models.attention import CacheShape
from corolla.models.devices import default_dtype, free_memory, resolve_device
from corolla.models.model_config import ModelConfig
from corolla.models.span import Span
from corolla.server.hosting.backend import compute_settings


@pytest.fixture
def two_gpus(monkeypatch):
    """What torch says on a machine with two CUDA devices, the second without bfloat16."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)


def test_the_default_is_the_best_device_here_and_cpu_means_cpu():
    expected = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    assert resolve_device(None).type == expected
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name", ["tpu", "gpu", "cuda:x", "", "cuda:-1"])
def test_a_device_that_is_no_device_is_refused_by_option(name):
    with pytest.raises(InvalidRequest, match=r"device \(--device\) must be one of auto, cpu, cuda"):
        resolve_device(name)


def test_cuda_without_a_gpu_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(InvalidRequest, match=r"device \(--device\) 'cuda': no CUDA device is visible"):
        resolve_device("cuda")
    option = "the draft model's device (--draft-device)"
    with pytest.raises(InvalidRequest, match=r"--draft-device\) 'cuda:0': no CUDA device"):
        resolve_device("cuda:0", option)


def test_cuda_devices_are_numbered_as_the_machine_has_them(two_gpus):
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert devices.best_device() == torch.device("cuda", 0)
    with pytest.raises(InvalidRequest, match=r"'cuda:2': this machine has CUDA devices 0..1"):
        resolve_device("cuda:2")


def test_the_dtype_follows_the_device(two_gpus, monkeypatch, tiny_models):
    assert default_dtype(torch.device("cpu")) == "float32"
    assert default_dtype(torch.device("cuda", 1)) == "float16"  # no bfloat16 on this GPU
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert default_dtype(torch.device("cuda", 0)) == "bfloat16"
    model = ModelConfig.from_folder(tiny_models["llama"])
    assert compute_settings(ServerConfig(model="m", device="cuda"), model) == (
        torch.device("cuda", 0),
        torch.bfloat16,
    )
    # an explicit --dtype wins over the device's default
    settings = compute_settings(ServerConfig(model="m", device="cuda:1", dtype="float32"), model)
    assert settings == (torch.device("cuda", 1), torch.float32)
    assert compute_settings(ServerConfig(model="m", device="cpu"), model) == (
        torch.device("cpu"),
        torch.float32,
    )


def test_free_memory_of_the_host():
    assert 0 < free_memory(torch.device("cpu")) <= devices.device_info(torch.device("cpu")).total_memory


def test_a_span_on_a_device_holds_every_weight_buffer_and_cache_page_there(tiny_models):
    # `meta` stands for an accelerator this machine lacks: tensors on it have shapes and no data, so
    # anything left on the CPU (or made there) shows
    span = Span.load(tiny_models["gemma2"], 1, 4, device="meta")
    assert span.device == torch.device("meta")
    placed = {t.device.type for t in [*span.parameters(), *span.buffers()]}
    assert placed == {"meta"}
    engine = Engine(span, EngineConfig(max_cache_tokens=64, page_size=4))
    pages = engine.pool.layer(0)
    assert pages.keys.device.type == pages.values.device.type == "meta"
    heads, dim = span.config.num_key_value_heads, span.config.head_dim
    assert set(span.cache_shapes.values()) == {CacheShape(heads, dim, heads, dim, gathers=False)}
