"""Start-up on every rank: meet the others, agree on flags, load this rank's shard, settle room.

Order matters: ranks meet through a store with a timeout that names whoever did not arrive; the
control group (gloo, CPU tensors) forms first on every device, so ranks on different devices or
builds still meet in the same collective and refuse together; flags (device type and torch, CUDA
and NCCL versions among them) are agreed before any GPU group or weight; between GPUs the NCCL
group is connected and exercised before the rank reports it started; room is the minimum over
ranks before any KV is allocated, so every rank allocates exactly the same pool.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from tpserve.kernels.attention_kernels import NATIVE, kv_dtype
from tpserve.kernels.int8_linear import int8_available
from tpserve.kernels.linear import ROW_TILE, linear
from tpserve.kernels.machine import describe_machine
from tpserve.kernels.weight_formats import quantize_unavailable
from tpserve.ranks.channel import Channel
from tpserve.ranks.collectives_choice import choose_collectives, choose_wire_exchange
from tpserve.ranks.decode_runner import model_graphs_unfit
from tpserve.ranks.device import choose_device, device_facts
from tpserve.ranks.engine import Engine
from tpserve.ranks.errors import StartupError, UserError
from tpserve.ranks.flags import agree_on_flags
from tpserve.ranks.kv_store import KVPool, kv_bytes_per_token
from tpserve.ranks.liveness import LeaderWatch, LivenessHub
from tpserve.ranks.loader import DTYPES, load_rank_model
from tpserve.ranks.meeting import meet, watch_peers
from tpserve.ranks.memory import free_memory_bytes
from tpserve.ranks.model_config import ModelConfig, load_model_config
from tpserve.ranks.model_group import open_model_group
from tpserve.ranks.network import check_interface, name_interface
from tpserve.ranks.packing import describe_serving
from tpserve.ranks.probe import ProbeFailure, probe_model, shape_dependent_linear
from tpserve.ranks.probe_mixed import probe_mixed_pass
from tpserve.ranks.settings import EngineSettings
from tpserve.ranks.unsupported import check_served_context

log = logging.getLogger(__name__)

KV_SHARE_OF_FREE_MEMORY = 0.5  # of what the rank finds free, after its weights are loaded


@dataclass(frozen=True)
class KVBudget:
    """What the pair's KV can hold, learned at start-up (the smallest rank's figures): room, the
    tokens of the KV pool's blocks (live streams and the cached prefixes they may share)."""

    kv_tokens: int
    kv_bytes_per_token: int  # this rank's


@dataclass
class RankRuntime:
    rank: int
    world_size: int
    config: ModelConfig
    engine: Engine
    channel: Channel
    kv_budget: KVBudget
    store: dist.Store
    settings: EngineSettings  # as started: every "auto" decided for this rank's device
    device: torch.device
    liveness: LivenessHub | LeaderWatch | None = None  # None at tp=1


def settle_room(settings: EngineSettings, rank: int, bytes_per_token: int, device, group) -> KVBudget:
    """room = MIN over ranks of what each rank's own budget holds, capped at lanes x context.

    Every check that can refuse is decided after the all-reduce, so every rank refuses together
    rather than one leaving the others stuck in the collective.
    """
    budgets = settings.kv_budget_bytes
    has_budget = not budgets or rank < len(budgets)
    if not budgets:
        budget = int(free_memory_bytes(device) * KV_SHARE_OF_FREE_MEMORY)
    else:
        budget = budgets[rank] if has_budget else 0
    block = settings.kv_block_size
    wanted = settings.num_lanes * -(-settings.context_size // block) * block  # whole blocks per lane
    figures = torch.tensor(
        [
            min(wanted, budget // bytes_per_token) // block * block,
            int(has_budget),
        ],
        dtype=torch.int64,
    )
    dist.all_reduce(figures, op=dist.ReduceOp.MIN, group=group)
    kv_tokens, every_rank_has_budget = figures.tolist()
    if not every_rank_has_budget:
        raise StartupError(
            f"rank {rank}: kv_budget_bytes must give one figure per rank, and some rank has none "
            f"(this rank was given {len(budgets)} for tp {settings.tp_size})"
        )
    if kv_tokens < 1:
        raise StartupError(
            f"rank {rank}: room for only {kv_tokens} KV tokens: the smallest rank's KV budget holds "
            f"none (this rank's: {budget} bytes at {bytes_per_token} bytes per token)"
        )
    return KVBudget(kv_tokens, bytes_per_token)


def check_quantize(settings: EngineSettings, device: torch.device) -> None:
    """Refuses a quantization this device cannot run, by name, before any rank loads a weight."""
    if settings.quantize == "none":
        return
    why_not = quantize_unavailable(settings.quantize, device)
    if why_not:
        raise UserError(f"quantize {settings.quantize}: {why_not}; serve with quantize: none")
    if settings.dtype != "float32":
        raise UserError(f"quantize {settings.quantize} computes in float32, not dtype {settings.dtype}")


def check_checkpoint_quantization(
    config: ModelConfig, settings: EngineSettings, device: torch.device
) -> None:
    """Refuses a pre-quantized (int8) checkpoint this device cannot serve, by name, before loading.

    Its int8 layers are served as stored whatever `quantize` says; `quantize` decides only the
    layers it left in float (usually the head): none keeps them float, int8 quantizes them at load.
    An int4 checkpoint's layers are served as stored where `quantize` is int4, else dequantized to
    float32 first (as a GGUF import's blocks are, tpserve/ranks/packing.py), and an fp8 one's are dequantized
    at load: any device serves them."""
    if config.quantization is None or "int8" not in config.quantization.kinds:
        return
    what = f"{settings.model_dir} is a {config.quantization.describe()} checkpoint"
    why_not = int8_available(device)
    if why_not:
        raise UserError(f"{what}: {why_not}; serve a float checkpoint there")
    if settings.dtype != "float32":
        raise UserError(f"{what}: its int8 layers compute in float32, not dtype {settings.dtype}")


def agree_on_attention(model, rank: int, group) -> None:
    """Every rank serves with one attention kernel: the C one only where every rank built it (a
    host with no compiler would otherwise give its heads other bits than tp=1 does)."""
    native = torch.tensor([model.attention is NATIVE], dtype=torch.int64)
    dist.all_reduce(native, op=dist.ReduceOp.MIN, group=group)
    if model.attention is NATIVE and not native.item():
        log.info("rank %d: another rank has no C attention kernel; all serve tiled", rank)
        model.serve_attention_tiled()
    log.info("rank %d: attention kernel: %s", rank, model.attention.name)


def check_invariance(
    model, rank: int, group, kv_type: torch.dtype, block_size: int, timeout_s: float, drill: bool = False
) -> None:
    """The start-up probe on every rank, then a vote: one rank's failure stops them all. The mixed
    pass runs on every rank whatever the products gave (its collectives pair up); the first failure
    is the one told."""
    log.info("rank %d: checking batch invariance on %s", rank, describe_machine())
    failure = None
    try:
        probe_model(model, product=shape_dependent_linear if drill else linear, kv_type=kv_type)
    except ProbeFailure as error:
        failure = str(error)
    try:
        probe_mixed_pass(model, kv_type, block_size, timeout_s)
    except ProbeFailure as error:
        failure = failure or str(error)
    passed = torch.tensor([failure is None], dtype=torch.int64)
    dist.all_reduce(passed, op=dist.ReduceOp.MIN, group=group)
    if failure is not None:
        raise StartupError(f"rank {rank}: batch invariance does not hold on this machine: {failure}")
    if not passed.item():
        raise StartupError(
            f"rank {rank}: another rank found batch invariance broken on its machine (see its log)"
        )


def start_rank(
    settings: EngineSettings,
    rank: int,
    world_size: int,
    host: str,
    port: int,
    *,
    agent_store: bool = False,
    local_rank: int | None = None,
    local_world_size: int | None = None,
) -> RankRuntime:
    """Start this rank. `local_rank` / `local_world_size` place it among the ranks on this host
    (default: torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE, else every rank on this host)."""
    if world_size != settings.tp_size:
        raise StartupError(f"tp is {settings.tp_size} but {world_size} ranks were started")
    torch.set_num_threads(settings.threads_per_rank or max(1, (os.cpu_count() or 2) // 2))
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    config = load_model_config(settings.model_dir)
    window = check_served_context(
        config.architecture,
        config.sliding_window,
        config.rope_scaling,
        settings.context_size,
        settings.model_dir,
    )
    if window is not None:
        log.info("rank %d: %s", rank, window)
    device, settings, facts, refusal = _place_on_device(settings, config, local_rank, local_world_size)
    store, control = _join_control_group(settings, rank, world_size, host, port, agent_store)
    agree_on_flags(settings, facts, rank, world_size, control, refusal)
    model, kv_type = _load_model(settings, config, rank, world_size, device, control)
    per_token = kv_bytes_per_token(config.num_layers, model.kv_heads_per_piece(), config.head_dim, kv_type)
    kv_budget = settle_room(settings, rank, per_token, device, control)
    log.info(
        "rank %d: room %d KV tokens in blocks of %d (%d bytes each here, in %s)",
        rank,
        kv_budget.kv_tokens,
        settings.kv_block_size,
        per_token,
        str(kv_type).removeprefix("torch."),
    )
    engine = _build_engine(settings, model, kv_budget, kv_type, rank, device)
    exchange = choose_wire_exchange(
        settings.cpu_collectives,
        rank=rank,
        world_size=world_size,
        device=device,
        control_group=control,
        timeout_s=settings.collective_timeout_s,
    )
    channel = Channel(
        control,
        store,
        rank=rank,
        timeout_s=settings.collective_timeout_s,
        leader_dead_after_s=settings.leader_dead_after_s,
        exchange=exchange,
    )
    # Last, once nothing can refuse any more: the heartbeat between rank 0 and each follower.
    liveness = watch_peers(store, rank, world_size, host, settings)
    if isinstance(liveness, LeaderWatch):
        channel.trust_leader_link(liveness.alive)
    return RankRuntime(
        rank, world_size, config, engine, channel, kv_budget, store, settings, device, liveness
    )


def _place_on_device(settings: EngineSettings, config: ModelConfig, local_rank: int, local_world_size: int):
    """(device, settings with every "auto" decided for it, its facts, None), or with a refusal in
    place of None: a refusal is told to the other ranks through the flags row, so they refuse at
    once rather than wait for this rank until init_timeout_s."""
    device, facts = torch.device("cpu"), None
    try:
        device = choose_device(settings.device, local_rank, local_world_size)
        settings = settings.for_device(device.type)
        check_quantize(settings, device)
        check_checkpoint_quantization(config, settings, device)
        facts = device_facts(device)
    except UserError as error:
        return device, settings, facts, error
    return device, settings, facts, None


def _join_control_group(
    settings: EngineSettings, rank: int, world_size: int, host: str, port: int, agent_store: bool
):
    """Meet the other ranks through the store, then form the control group: (store, group).

    It forms first, on every device: wire messages, votes, flags and room travel here as CPU
    tensors; the model's collectives get a group of their own between GPUs."""
    if settings.interface:
        check_interface(settings.interface, host, port, rank)
        name_interface(settings.interface)
    store = meet(rank, world_size, host, port, settings.init_timeout_s, agent_store)
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("pg", store),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=settings.collective_timeout_s),
    )
    return store, dist.group.WORLD


def _load_model(settings: EngineSettings, config: ModelConfig, rank: int, world_size: int, device, control):
    """This rank's shard on its device, with its collectives, proven batch invariant when asked; and
    the dtype its KV pool holds (which follows the attention kernel the ranks agreed on)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model_group = open_model_group(device, rank, world_size, settings.collective_timeout_s)
    collectives = choose_collectives(
        settings.cpu_collectives,
        rank=rank,
        world_size=world_size,
        device=device,
        model_group=model_group,
        control_group=control,
        timeout_s=settings.collective_timeout_s,
    )
    log.info(
        "rank %d: loading %s on %s (%s, weights %s, tp=%d, batch_invariant=%s)",
        rank,
        settings.model_dir,
        device,
        settings.dtype,
        settings.quantize,
        world_size,
        settings.batch_invariant,
    )
    if config.quantization is not None:
        log.info(
            "rank %d: %s: %s",
            rank,
            config.quantization.describe(),
            describe_serving(config.quantization.kinds, settings.quantize, device.type),
        )
    model = load_rank_model(
        settings.model_dir,
        tp_rank=rank,
        tp_size=world_size,
        dtype=DTYPES[settings.dtype],
        max_positions=settings.context_size,
        collectives=collectives,
        config=config,
        row_tile=ROW_TILE if settings.batch_invariant else 0,
        device=device,
        quantize=settings.quantize,
    )
    if settings.batch_invariant:
        agree_on_attention(model, rank, control)
    kv_type = kv_dtype(settings.kv_dtype, model.attention, DTYPES[settings.dtype])
    if settings.batch_invariant:
        check_invariance(
            model,
            rank,
            control,
            kv_type,
            settings.kv_block_size,
            settings.collective_timeout_s,
            drill=settings.shape_dependent_on_rank == rank,
        )
    return model, kv_type


def _build_engine(
    settings: EngineSettings, model, kv_budget: KVBudget, kv_type: torch.dtype, rank: int, device
) -> Engine:
    """The KV store sized by room, in blocks (one more as the graphs' spare block), and the engine."""
    config, kv_heads = model.config, model.kv_heads_per_piece()
    why_not = model_graphs_unfit(model, settings.tp_size)
    log.info("rank %d: decode rounds %s", rank, f"eager: {why_not}" if why_not else "replay CUDA graphs")
    kv = KVPool(
        config.num_layers,
        kv_budget.kv_tokens + (0 if why_not else settings.kv_block_size),
        kv_heads,
        config.head_dim,
        kv_type,
        device,
        block_size=settings.kv_block_size,
    )
    drill = settings.refuse_token_on_rank
    return Engine(
        model,
        kv,
        refuse_token=drill[1] if drill and drill[0] == rank else None,
        device_timeout_s=settings.collective_timeout_s,
        decode_graphs=why_not is None,
    )


def shutdown(runtime: RankRuntime | None = None) -> None:
    """Leave cleanly (after Stop): say BYE on the liveness link, and leave the process group so no
    gloo thread outlives the interpreter."""
    if runtime is not None and runtime.liveness is not None:
        runtime.liveness.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def leave(code: int) -> NoReturn:
    """A rank's process ends here, once its work is done, with `code`, after flushing its logs.

    Never through the interpreter's exit: native threads may still run then (gloo's, in a group a
    failure left standing; after a clean stop, rarely, another library's), and a joinable native
    thread met at teardown aborts the process ("terminate called", SIGABRT: exit -6 instead of 0)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
