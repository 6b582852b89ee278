"""Data parallelism for the trainers under torchrun: DistributedDataParallel, NCCL on GPU, gloo on CPU.

    torchrun --standalone --nproc_per_node N -m pipeline.training.qa_vlm --config configs/qa_vlm_multi.yaml ...

Each process (rank) builds the same model from the same seed, takes its share of every step's
clips (Ranks.shard) and runs its forward through DistributedDataParallel, whose backward averages
the gradients over the ranks, so every rank's optimizer makes the same step. Rank 0 alone
validates, checkpoints, exports and logs. At the end the ranks compare their weights
(`check_in_sync`): a rank that drifted is an error, not a silent bad snapshot. Without torchrun
(WORLD_SIZE unset or 1) nothing here changes a run.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def shard(self, items: range) -> range:
        """This rank's share of a step's items: every world-th from its rank."""
        return items[self.rank::self.world]


def setup(device: torch.device) -> tuple[Ranks, torch.device]:
    """Join torchrun's process group when WORLD_SIZE > 1 (NCCL on CUDA, gloo on CPU); -> the ranks
    and this rank's device (its LOCAL_RANK's GPU on CUDA)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Ranks(), device
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        if local >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK {local} has no GPU: {torch.cuda.device_count()} visible; "
                               f"run at most that many processes per node")
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Ranks(rank, world, local), device


class _Step(torch.nn.Module):
    """The modules one training step updates, with the step's forward as its own: DDP synchronises
    the gradients of what its forward ran."""

    def __init__(self, modules: torch.nn.ModuleList, forward: Callable[[Any], Any]) -> None:
        super().__init__()
        self.trained = modules
        self._forward = forward

    def forward(self, batch: Any) -> Any:
        return self._forward(batch)


def wrap(modules: torch.nn.ModuleList, forward: Callable[[Any], Any], ranks: Ranks,
         device: torch.device) -> Callable[[Any], Any]:
    """forward itself on one process; under torchrun a DistributedDataParallel over `modules`
    (which must hold every parameter forward trains) that runs it."""
    if not ranks.distributed:
        return forward
    ids = [device.index] if device.type == "cuda" else None
    # aux heads of a zero weight take no part in the loss: find_unused_parameters lets DDP skip them
    return torch.nn.parallel.DistributedDataParallel(_Step(modules, forward), device_ids=ids,
                                                     find_unused_parameters=True)


def fingerprint(module: torch.nn.Module) -> torch.Tensor:
    """(P, 2) float64 sum and sum of squares of each parameter: equal on ranks that stayed in sync."""
    return torch.stack([torch.stack([p.detach().double().sum(), p.detach().double().square().sum()])
                        for p in module.parameters()]).cpu()


def check_in_sync(module: torch.nn.Module, ranks: Ranks) -> list[list[float]]:
    """Every rank's fingerprint of `module` (rank order); raises if any differs from rank 0's."""
    mine = fingerprint(module)
    if not ranks.distributed:
        return [mine.sum(0).tolist()]
    gathered = [torch.zeros_like(mine) for _ in range(ranks.world)]
    backend_device = torch.device("cuda", ranks.local) if torch.distributed.get_backend() == "nccl" else None
    if backend_device is not None:
        local = [g.to(backend_device) for g in gathered]
        torch.distributed.all_gather(local, mine.to(backend_device))
        gathered = [g.cpu() for g in local]
    else:
        torch.distributed.all_gather(gathered, mine)
    for r, other in enumerate(gathered[1:], 1):
        if not torch.allclose(other, gathered[0], rtol=1e-9, atol=0.0):
            raise RuntimeError(f"rank {r}'s weights differ from rank 0's after training: the ranks drifted apart")
    return [g.sum(0).tolist() for g in gathered]


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when flag is True on any (a decision all ranks must take together)."""
    t = torch.tensor([int(flag)], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())


def teardown(ranks: Ranks) -> None:
    """Every rank at the end together, then the process group destroyed; with gloo, not destroyed:
    once its peer had exited, a rank's destroy_process_group could hang (seen on a 2-core CPU run
    under load: rank 0 in futex waits for minutes after writing its files, rank 1 gone). The
    process's exit frees the group."""
    if ranks.distributed and torch.distributed.is_initialized():
        torch.distributed.barrier()
        if torch.distributed.get_backend() != "gloo":
            torch.distributed.destroy_process_group()
