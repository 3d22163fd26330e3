"""The GPU wiring, checked on a CPU machine with torch.cuda monkeypatched: which device each rank
takes, what it refuses, how much memory it finds free, what its flags row says, which defaults a
GPU gets, and that every wait for the device gives up at its deadline."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from tiny_models import write_tiny_model

from tpserve.ranks import device as device_module
from tpserve.ranks import memory, model_group
from tpserve.ranks.device import DeviceError, choose_device, device_facts
from tpserve.ranks.device_wait import DeviceTimeout, wait_for
from tpserve.ranks.flags import FLAG_NAMES, flags_row, shown_row
from tpserve.ranks.model_config import load_model_config
from tpserve.ranks.model_group import ModelGroupError, _within, open_model_group, watchdog_timeout_s
from tpserve.ranks.models.llama import LlamaModel
from tpserve.ranks.settings import EngineSettings
from tpserve.ranks.sharding import pieces_of_rank
from tpserve.ranks.weights import read_rank_weights
from tpserve.serve import place
from tpserve.server.config import ConfigError, load_config

GIB = 1 << 30


def gpus(monkeypatch, count: int, *, cuda: str | None = "13.0", present: bool = True) -> None:
    """This machine has `count` GPUs torch can use (none usable when count is 0: `present` says
    whether the machine still has one that this torch build cannot use)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(device_module, "nvidia_gpu_present", lambda: present)


def test_each_local_rank_takes_its_own_gpu(monkeypatch):
    gpus(monkeypatch, 2)
    assert [choose_device("auto", rank, 2) for rank in (0, 1)] == [
        torch.device("cuda", 0),
        torch.device("cuda", 1),
    ]
    assert choose_device("cuda", 0, 1) == torch.device("cuda", 0)  # one rank per host (two hosts)


def test_each_way_of_starting_places_the_ranks_on_their_hosts(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    alone = place(load_config(None, {"tp": "2"}))  # `tpserve serve`: the follower is a child here
    assert (alone.local_rank, alone.local_world_size, alone.spawn_followers) == (0, 2, True)
    pair = place(load_config(None, {"tp": "2", "rank": "1", "master": "hostA:29500"}))
    assert (pair.rank, pair.local_rank, pair.local_world_size) == (1, 0, 1)  # one rank per host
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    torchrun = place(load_config(None, {"tp": "2"}))  # both ranks on this host under torchrun
    assert (torchrun.rank, torchrun.local_rank, torchrun.local_world_size) == (1, 1, 2)


def test_more_ranks_on_a_host_than_gpus_are_refused_with_the_way_out(monkeypatch):
    gpus(monkeypatch, 1)
    for rank in (0, 1):
        with pytest.raises(DeviceError, match=r"2 ranks on this host but 1 GPU\(s\)") as refused:
            choose_device("auto", rank, 2)
        assert "--tp 1" in str(refused.value) and "--master" in str(refused.value)


def test_auto_never_falls_back_to_the_cpu_where_a_gpu_is_present(monkeypatch):
    gpus(monkeypatch, 0, cuda=None, present=True)  # a CPU build of torch on a GPU machine
    with pytest.raises(DeviceError, match="refusing to fall back to the CPU") as refused:
        choose_device("auto", 0, 2)
    assert "CPU-only build" in str(refused.value)
    assert choose_device("cpu", 0, 2) == torch.device("cpu")  # asked for, on purpose


def test_a_cuda_build_the_driver_cannot_run_is_named(monkeypatch):
    gpus(monkeypatch, 0, cuda="13.0", present=True)
    with pytest.raises(DeviceError, match=r"built for CUDA 13.0, but finds no usable GPU"):
        choose_device("auto", 0, 1)
    with pytest.raises(DeviceError, match="device is cuda"):
        choose_device("cuda", 0, 1)


def test_auto_takes_the_cpu_where_there_is_no_gpu(monkeypatch):
    gpus(monkeypatch, 0, cuda=None, present=False)
    assert choose_device("auto", 1, 2) == torch.device("cpu")
    with pytest.raises(DeviceError, match="device is cuda, but torch .* CPU-only build"):
        choose_device("cuda", 0, 2)


def fake_gpu_memory(monkeypatch, *, integrated: bool, free: int, cached: int) -> list[str]:
    """A GPU with `free` bytes free once torch's allocator hands back its `cached` bytes."""
    calls: list[str] = []
    state = {"cached": cached}

    def empty_cache() -> None:
        calls.append("empty_cache")
        state["cached"] = 0

    def mem_get_info(device=None):
        calls.append("mem_get_info")
        return free - state["cached"], 128 * GIB

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: SimpleNamespace(is_integrated=integrated)
    )
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 100 * GIB - state["cached"])
    return calls


def test_room_is_measured_after_the_allocator_hands_back_what_loading_freed(monkeypatch):
    calls = fake_gpu_memory(monkeypatch, integrated=False, free=40 * GIB, cached=3 * GIB)
    assert memory.free_memory_bytes(torch.device("cuda", 0)) == 40 * GIB
    assert calls == ["empty_cache", "mem_get_info"]


def test_a_unified_memory_gpu_measures_the_hosts_available_memory(monkeypatch):
    # A GB10: CUDA's free figure does not see what the host uses; the host's figure does.
    calls = fake_gpu_memory(monkeypatch, integrated=True, free=120 * GIB, cached=2 * GIB)
    assert memory.free_memory_bytes(torch.device("cuda", 0)) == 100 * GIB
    assert calls == ["empty_cache"]


def test_the_flags_row_shows_the_device_and_the_torch_cuda_and_nccl_versions(monkeypatch, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    settings = EngineSettings(model_dir=str(tmp_path)).for_device("cpu")
    monkeypatch.setattr(torch, "__version__", "2.13.0+cu130")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 7))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (12, 1))
    gb10 = flags_row(settings, device_facts(torch.device("cuda", 0)))
    assert "device=cuda, torch=2.13.0, cuda=13.0.0, nccl=2.27.7, capability=sm_121" in shown_row(gb10)
    cpu = shown_row(flags_row(settings, device_facts(torch.device("cpu"))))
    assert "device=cpu, torch=2.13.0, cuda=none, nccl=none, capability=none" in cpu
    # a rank on another GPU generation (an H100 beside a GB10) differs in that column alone
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    hopper = flags_row(settings, device_facts(torch.device("cuda", 0)))
    differ = [name for name, a, b in zip(FLAG_NAMES, gb10, hopper) if a != b]
    assert differ == ["capability"] and "capability=sm_90, attention=" in shown_row(hopper)
    for code, version in ((2708, (2, 7, 8)), (21903, (2, 19, 3))):  # as older builds report it
        monkeypatch.setattr(torch.cuda.nccl, "version", lambda code=code: code)
        assert device_facts(torch.device("cuda", 0)).nccl_version == version
    refused = shown_row(flags_row(settings, None))
    assert "device=refused" in refused
    assert len(flags_row(settings, None)) == len(FLAG_NAMES)


def test_ranks_with_and_without_flashinfer_differ_in_the_attention_column(monkeypatch, tmp_path):
    # Two GPU ranks in bfloat16, one with FlashInfer installed (a package on its path), one without:
    # their rows differ in the attention column alone, so they refuse to start together.
    (tmp_path / "config.json").write_text("{}")
    gpus(monkeypatch, 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 7))
    settings = EngineSettings(model_dir=str(tmp_path), dtype="auto").for_device("cuda")
    facts = device_facts(torch.device("cuda", 0))
    without = flags_row(settings, facts)
    assert shown_row(without).endswith("attention=sdpa")
    package = tmp_path / "site" / "flashinfer"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with_flashinfer = flags_row(settings, facts)
    assert [n for n, a, b in zip(FLAG_NAMES, without, with_flashinfer) if a != b] == ["attention"]
    assert shown_row(with_flashinfer).endswith("attention=flashinfer")
    # batch invariance asked for: native or tiled, agreed after loading, whatever is installed
    invariant = EngineSettings(model_dir=str(tmp_path), batch_invariant=True).for_device("cuda")
    assert shown_row(flags_row(invariant, facts)).endswith("attention=invariant")
    cpu = EngineSettings(model_dir=str(tmp_path), batch_invariant=False).for_device("cpu")
    assert shown_row(flags_row(cpu, device_facts(torch.device("cpu")))).endswith("attention=sdpa")


def test_gpu_defaults_claim_no_exactness_the_kernels_do_not_give(tmp_path):
    auto = EngineSettings(model_dir="m", dtype="auto", batch_invariant=None, draft_tokens=None)
    gpu = auto.for_device("cuda")
    assert (gpu.dtype, gpu.batch_invariant, gpu.draft_tokens) == ("bfloat16", False, 0)
    cpu = auto.for_device("cpu")
    assert (cpu.dtype, cpu.batch_invariant, cpu.draft_tokens) == ("float32", True, 15)
    # Asked for on a GPU, it stands: the start-up probe then decides (every rank refuses if it fails).
    assert EngineSettings(model_dir="m", batch_invariant=True).for_device("cuda").batch_invariant is True
    # What the user set stands where it holds.
    assert (
        EngineSettings(model_dir="m", dtype="float32", batch_invariant=None).for_device("cuda").dtype
        == "float32"
    )


def test_the_config_takes_device_and_auto_and_refuses_a_bad_device(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("device: cuda\nbatch_invariant: auto\ndraft_tokens: auto\ndtype: auto\n")
    config = load_config(path, {"batch_invariant": None})
    settings = config.engine_settings("m")
    assert (settings.device, settings.batch_invariant, settings.draft_tokens, settings.dtype) == (
        "cuda",
        None,
        None,
        "auto",
    )
    assert load_config(None, {"batch_invariant": "false", "draft_tokens": "4"}).draft_tokens == 4
    with pytest.raises(ConfigError, match=r"device: 'gpu' is not one of auto, cpu, cuda"):
        load_config(None, {"device": "gpu"})
    with pytest.raises(ConfigError, match="draft_tokens: must be between 0 and 15"):
        load_config(None, {"draft_tokens": "16"})


class Completion:
    """A device event that completes after `after` queries (never, when None)."""

    def __init__(self, after: int | None):
        self.after, self.queries = after, 0

    def query(self) -> bool:
        self.queries += 1
        return self.after is not None and self.queries > self.after


def test_a_wait_for_the_device_gives_up_at_its_deadline_saying_what_it_waited_for():
    with pytest.raises(
        DeviceTimeout, match=r"rank 0: the logits of Round #7: the device did not finish within 0.2s"
    ):
        wait_for(Completion(None), 0.2, "rank 0: the logits of Round #7")


def test_a_wait_for_the_device_returns_once_the_work_is_done():
    done = Completion(after=3)
    wait_for(done, 30.0, "never said")
    assert done.queries == 4


def test_nccl_is_connected_with_its_device_and_exercised_before_the_rank_starts(monkeypatch):
    made, exercised = {}, []
    monkeypatch.setattr(model_group.dist, "new_group", lambda **kwargs: made.update(kwargs) or "nccl group")
    monkeypatch.setattr(model_group, "exercise", lambda *args: exercised.append(args))
    device = torch.device("cuda", 1)
    assert open_model_group(device, 1, 2, 60.0) == "nccl group"
    # device_id makes NCCL connect now, not at the first request.
    assert (made["backend"], made["device_id"]) == ("nccl", device)
    assert made["timeout"].total_seconds() == watchdog_timeout_s(60.0)
    assert exercised == [("nccl group", 1, 2, device, 60.0)]
    # On the CPU, and at tp=1, the model's collectives need no group of their own.
    assert open_model_group(torch.device("cpu"), 0, 2, 60.0) is torch.distributed.group.WORLD
    assert open_model_group(device, 0, 1, 60.0) is torch.distributed.group.WORLD
    assert len(exercised) == 1


def test_nccls_watchdog_fires_only_after_the_ranks_own_deadline():
    for timeout_s in (1.0, 60.0, 120.0):
        assert watchdog_timeout_s(timeout_s) > timeout_s + 10


def test_a_group_that_never_forms_is_given_up_on_by_name():
    never = threading.Event()
    with pytest.raises(
        ModelGroupError, match="rank 1: NCCL's connection to the other ranks did not form within 0.2s"
    ):
        _within(0.2, "rank 1: NCCL's connection to the other ranks", never.wait)
    never.set()
    assert _within(5.0, "formed", lambda: "group") == "group"


def _storage_bytes(tensors) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_a_rank_holds_the_bytes_of_its_shard_once_so_room_sees_only_that(tmp_path, tp_rank):
    # Two ways to hold more: a slice that keeps the whole tensor it was cut from, and the loaded
    # q/k/v and gate/up pieces outliving their fused copies.
    model_dir = write_tiny_model(tmp_path / "qwen2", "qwen2")
    config = load_model_config(model_dir)
    pieces = pieces_of_rank(config, tp_rank, 2)
    weights = read_rank_weights(model_dir, config, pieces, torch.float32)
    model = LlamaModel(config, weights, pieces, tp_rank=tp_rank, tp_size=2, max_positions=64)
    used = [*weights.replicated.values(), *model.embed_tokens.tables, *model.lm_head.weights]
    for layer in model.layers:
        used += [
            t
            for attention, mlp in zip(layer.self_attn.pieces, layer.mlp.pieces)
            for t in (attention.w_qkv, attention.b_qkv, attention.w_o, mlp.w_gate_up, mlp.w_down)
            if t is not None
        ]
    left_in_weights = [t for piece in weights.pieces for t in piece.values()]
    held = _storage_bytes(used + left_in_weights)
    assert held == sum(t.numel() * t.element_size() for t in {id(t): t for t in used}.values())
