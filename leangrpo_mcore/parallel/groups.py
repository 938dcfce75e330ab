"""Which (prompt, generation) samples each data-parallel rank makes, and who shares a prompt group.

Layouts (LeanGRPO §4.1, docs/algorithms.md §6):

- ``shared``, M ≥ R: every rank holds every prompt; rank r makes generations m = q·R + r (q < Q = M/R).
  The M rewards of a prompt are all-gathered over the whole data-parallel group.
- ``shared``, M < R: R/M worker groups of M consecutive ranks; worker group w takes prompts p ≡ w
  (mod R/M) and its j-th rank makes generation j. Rewards are gathered inside the worker group.
- ``conventional`` (the baselines): rank r holds whole groups, prompts p ≡ r (mod R); nothing to gather.

Ranks here are data-parallel indices (0 .. R−1); tensor-parallel peers of a data-parallel index make the
same samples. :func:`assign_samples` is plain arithmetic; :func:`build_group_process_groups` creates the
gather groups (a collective call: every rank must call it with the same arguments).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from leangrpo_mcore.parallel.mesh import default_group_timeout

LAYOUTS = ("shared", "conventional")


@dataclass(frozen=True)
class PromptShare:
    """This rank's part of one prompt group."""

    prompt_slot: int
    """Index of the prompt within the step (0 .. prompts_per_step − 1)."""
    generation_ids: tuple[int, ...]
    """Generations of the prompt made on this rank, ascending."""
    group_ranks: tuple[int, ...]
    """Data-parallel ranks holding the prompt's generations, in gather order."""

    def gathered_generation_ids(self, group_size: int) -> list[list[int]]:
        """Per rank of ``group_ranks`` (in order), the generation ids it holds."""
        return [generation_ids_of(rank_index, len(self.group_ranks), group_size)
                for rank_index in range(len(self.group_ranks))]


def generation_ids_of(rank_in_group: int, ranks_in_group: int, group_size: int) -> list[int]:
    """Generations made by the ``rank_in_group``-th of ``ranks_in_group`` ranks sharing a prompt."""
    return list(range(rank_in_group, group_size, ranks_in_group))


def check_layout(layout: str, dp_size: int, group_size: int, prompts_per_step: int) -> None:
    """Raise ValueError (one line) when the samples of a step cannot be split evenly over the ranks."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; valid: {', '.join(LAYOUTS)}")
    if min(dp_size, group_size, prompts_per_step) < 1:
        raise ValueError("data-parallel size, group size and prompts per step must be >= 1")
    if layout == "conventional":
        if prompts_per_step % dp_size:
            raise ValueError(
                f"conventional layout: prompts_per_step ({prompts_per_step}) must be a multiple of the "
                f"data-parallel size ({dp_size})"
            )
        return
    if group_size >= dp_size:
        if group_size % dp_size:
            raise ValueError(f"shared layout: group_size ({group_size}) must be a multiple of the data-parallel "
                             f"size ({dp_size})")
        return
    if dp_size % group_size:
        raise ValueError(f"shared layout: the data-parallel size ({dp_size}) must be a multiple of group_size "
                         f"({group_size})")
    workers = dp_size // group_size
    if prompts_per_step % workers:
        raise ValueError(f"shared layout: prompts_per_step ({prompts_per_step}) must be a multiple of the "
                         f"{workers} worker groups")


def assign_samples(layout: str, dp_rank: int, dp_size: int, group_size: int,
                   prompts_per_step: int) -> list[PromptShare]:
    """This rank's :class:`PromptShare` of every prompt it takes part in, by ascending prompt slot."""
    check_layout(layout, dp_size, group_size, prompts_per_step)
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
    if layout == "conventional":
        return [PromptShare(p, tuple(range(group_size)), (dp_rank,))
                for p in range(dp_rank, prompts_per_step, dp_size)]
    if group_size >= dp_size:
        ranks = tuple(range(dp_size))
        gens = tuple(generation_ids_of(dp_rank, dp_size, group_size))
        return [PromptShare(p, gens, ranks) for p in range(prompts_per_step)]
    workers = dp_size // group_size
    worker, index = divmod(dp_rank, group_size)
    ranks = tuple(range(worker * group_size, (worker + 1) * group_size))
    return [PromptShare(p, (index,), ranks) for p in range(worker, prompts_per_step, workers)]


def check_updates(layout: str, dp_size: int, group_size: int, prompts_per_step: int, updates: int) -> None:
    """ValueError (one line) unless every data-parallel rank holds the same number of samples in every one of the
    ``updates`` optimizer steps of a rollout (update k trains prompt slots [k P/K, (k+1) P/K)). A rank with nothing
    to do in an update would skip that update's collectives while the others wait in them."""
    if updates <= 1:
        return
    per_update = prompts_per_step // updates
    counts = set()
    for rank in range(dp_size):
        for k in range(updates):
            held = sum(len(s.generation_ids) for s in assign_samples(layout, rank, dp_size, group_size,
                                                                    prompts_per_step)
                       if s.prompt_slot // per_update == k)
            counts.add(held)
            if held == 0:
                raise ValueError(f"grpo.updates_per_rollout={updates}: data-parallel rank {rank} holds no sample of "
                                 f"update {k} ({layout} layout, {prompts_per_step} prompts x {group_size} over "
                                 f"{dp_size} ranks); every rank must take part in every update: raise "
                                 f"grpo.prompts_per_step or lower grpo.updates_per_rollout")
    if len(counts) > 1:
        raise ValueError(f"grpo.updates_per_rollout={updates}: the ranks hold {sorted(counts)} samples in different "
                         f"updates ({layout} layout); every rank must hold the same number in every update")


def gather_rank_sets(layout: str, dp_size: int, group_size: int) -> list[tuple[int, ...]]:
    """Every distinct set of data-parallel ranks that gathers rewards (more than one rank), in a fixed order."""
    if layout == "conventional" or dp_size == 1:
        return []
    if group_size >= dp_size:
        return [tuple(range(dp_size))]
    return [tuple(range(w * group_size, (w + 1) * group_size)) for w in range(dp_size // group_size)]


def build_group_process_groups(layout: str, dp_size: int, group_size: int, dp_global_ranks: list[list[int]],
                               timeout: Optional[timedelta] = None):
    """Create the reward-gather process groups; returns {dp rank set: group} for this rank's TP column.

    ``dp_global_ranks[k]`` lists the global ranks of data-parallel group k (one per tensor-parallel rank,
    ordered by data-parallel index). Every rank must call this with identical arguments (``new_group`` is
    collective); a rank only keeps the groups it belongs to. The groups time out after ``timeout`` (default:
    the default group's, ``parallel.timeout_minutes``).
    """
    mine: dict[tuple[int, ...], object] = {}
    me = dist.get_rank()
    timeout = timeout if timeout is not None else default_group_timeout()
    for rank_set in gather_rank_sets(layout, dp_size, group_size):
        for column in dp_global_ranks:
            members = [column[i] for i in rank_set]
            group = dist.new_group(members, timeout=timeout)
            if me in members:
                mine[rank_set] = group
    return mine


def gather_group_rewards(local: torch.Tensor, share: PromptShare, group_size: int, group) -> torch.Tensor:
    """(M,) rewards of a prompt group in generation order, all-gathered among ``share.group_ranks``; (M, K) for
    (B, K) component rewards (``reward.aggregate: advantages``), each sample's row travelling whole.

    ``local`` holds this rank's rewards for ``share.generation_ids``; ``group`` is the process group of the
    ranks sharing the prompt (None when this rank holds the whole group).
    """
    local = local.detach().to(torch.float32)
    if len(share.group_ranks) == 1:
        if local.shape[0] != group_size:
            raise ValueError(f"a rank holding the whole group needs {group_size} rewards, got {local.shape[0]}")
        return local.cpu()
    pieces = [torch.empty_like(local) for _ in share.group_ranks]
    dist.all_gather(pieces, local, group=group)
    out = torch.empty(group_size, *local.shape[1:], dtype=torch.float32)
    for ids, piece in zip(share.gathered_generation_ids(group_size), pieces):
        out[torch.tensor(ids, dtype=torch.long)] = piece.cpu()
    return out


def gather_step_rewards(local: dict[tuple[int, int], float | list[float]], prompts_per_step: int, group_size: int,
                        dp_group, device: torch.device, components: int = 0) -> torch.Tensor:
    """(P, M) rewards of the whole step over the data-parallel group; (P, M, K) with ``components`` = K > 0.

    ``local`` maps (prompt slot, generation) → reward (a list of K rewards with components) for the samples made
    on this rank. Each entry is owned by exactly one data-parallel rank, so a SUM all-reduce of the zero-filled
    tables is an exact gather.
    """
    table = torch.zeros(prompts_per_step, group_size, *((components,) if components else ()), dtype=torch.float32)
    owned = torch.zeros(prompts_per_step, group_size, dtype=torch.float32)
    for (slot, gen), value in local.items():
        table[slot, gen] = torch.as_tensor(value, dtype=torch.float32)
        owned[slot, gen] = 1.0
    if dp_group is not None:
        both = torch.cat([table.flatten(), owned.flatten()]).to(device)
        dist.all_reduce(both, group=dp_group)
        table, owned = both[:table.numel()].view(table.shape).cpu(), both[table.numel():].view(owned.shape).cpu()
    simulated = dp_group is not None and dist.get_backend(dp_group) == "fake"  # sums nothing: others' rows stay 0
    if not simulated and not bool((owned == 1).all()):
        raise RuntimeError("the step's rewards are not owned exactly once over the data-parallel ranks")
    return table
