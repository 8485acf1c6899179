"""The memory check before a packed copy of the weights (memory.py): what the process may
still take, read from files laid out as /proc/meminfo and a cgroup's are, and what happens
when a copy would not fit: a warning naming both sizes, and answers from the model's own
weights."""

from __future__ import annotations

import copy

import pytest
import torch

from genlm_fast.backend.llm import cpu_linear, memory

from .small_models import small_model


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """Write ``MemAvailable`` (bytes) and a cgroup v2 limit and usage (None: no limit)."""
    meminfo = tmp_path / "meminfo"
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    monkeypatch.setattr(memory, "MEMINFO", str(meminfo))
    monkeypatch.setattr(memory, "CGROUP_ROOT", str(cgroup))

    def set_memory(available, limit=None, usage=0):
        meminfo.write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available // 1024} kB\n")
        (cgroup / "memory.max").write_text("max\n" if limit is None else f"{limit}\n")
        (cgroup / "memory.current").write_text(f"{usage}\n")

    return set_memory


def test_room_is_the_least_of_mem_available_and_the_cgroup_limit(machine):
    machine(8 << 30)
    room = memory.room()
    assert room.bytes == 8 << 30 and "MemAvailable is 8.59 GB" in room.source
    machine(8 << 30, limit=6 << 30, usage=2 << 30)
    room = memory.room()
    assert room.bytes == 4 << 30
    assert "cgroup's memory limit (6.44 GB) leaves 4.29 GB" in room.source
    machine(1 << 30, limit=6 << 30, usage=2 << 30)
    assert memory.room().bytes == 1 << 30


def test_shortfall_names_what_is_needed_and_what_is_left(machine):
    machine(4 << 30)
    assert memory.shortfall(3 << 30, "a copy") is None
    message = memory.shortfall(4 << 30, "a copy")  # no room for the margin
    assert message == "a copy would take 4.29 GB, and MemAvailable is 4.29 GB"


def test_unknown_room_refuses_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "MEMINFO", str(tmp_path / "absent"))
    monkeypatch.setattr(memory, "CGROUP_ROOT", str(tmp_path / "absent"))
    monkeypatch.setattr(memory, "_cgroup_room", lambda: None)
    assert memory.room().bytes is None
    assert memory.shortfall(1 << 60, "a copy") is None


def _needs_kernel(kernel, capability):
    """Skip where the CPU cannot run ``kernel``; fail where it can but the kernel does not
    run (a broken build)."""
    if kernel in cpu_linear.available_kernels():
        return
    if torch.backends.cpu.get_cpu_capability().startswith(capability):
        pytest.fail(f"this CPU runs {capability} code but the {kernel} kernel is unavailable")
    pytest.skip(f"the {kernel} kernel needs a CPU with {capability}")


def _linear_model_and_oracle():
    model = small_model(300, "llama").float()
    return model, copy.deepcopy(model).double()


def _assert_answers_float64(model, oracle):
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        got = model(ids).logits.double()
        want = oracle(ids).logits
    assert (got - want).abs().max() < 1e-4


def test_linear_layers_too_big_to_pack_run_torchs_own(machine):
    """No room for the avx512 kernel's packed copies: a warning naming both sizes, no layer
    changed, and the answers are those of the model's own layers (float64 oracle)."""
    _needs_kernel("avx512", "AVX512")
    model, oracle = _linear_model_and_oracle()
    machine(64 << 10)  # 64 KB: less than the layers' weights
    with pytest.warns(RuntimeWarning, match=r"packing the linear layers .* would take .* GB"):
        assert cpu_linear.pack_linear_layers(model, "avx512") == 0
    assert all("forward" not in m.__dict__ for m in model.modules())
    _assert_answers_float64(model, oracle)
    machine(8 << 30)
    assert cpu_linear.pack_linear_layers(model, "avx512") > 0  # with room, they pack
    cpu_linear.unpack_linear_layers(model)


def test_linear_rows_needs_no_room(machine, recwarn):
    """The rows kernel reads the weights in place: however little room is left, every layer
    takes it, with no warning, and the answers match float64."""
    _needs_kernel("rows", "AVX")
    model, oracle = _linear_model_and_oracle()
    machine(64 << 10)
    layers = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert cpu_linear.pack_linear_layers(model, "rows") == layers > 0
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
    _assert_answers_float64(model, oracle)
    cpu_linear.unpack_linear_layers(model)
