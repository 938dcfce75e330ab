"""Context (sequence) parallelism: the tokens of one sample split over the CP group, Ulysses attention.

The CP group comes from ``megatron.core.parallel_state`` (``context_parallel_size``); without it everything is
CP = 1 and :func:`attend` is the plain kernel call. A sequence of ``total`` tokens is split into contiguous
pieces, rank r holding ``sizes[r]`` tokens (the first ``total % cp`` ranks one more: no padding, so no
attention mask). Every per-token layer (linears, norms, modulation, MLP, RoPE with the rank's own positions)
runs on the local tokens only; attention exchanges them with two all-to-alls (DeepSpeed-Ulysses,
docs/models.md "Sequence parallelism"):

- q, k, v (B, S_r, H, D) → (B, S, H / cp, D): every rank gathers the whole sequence for H / cp heads;
- the attention output goes back the same way, (B, S, H / cp, D) → (B, S_r, H, D).

Attention is invariant under a permutation of its keys, and each query row returns to its owner, so the
gathered order (rank 0's tokens, then rank 1's, ...) may interleave streams: FLUX's joint sequence is
[text_r, image_r] on rank r and [text_0, image_0, text_1, image_1, ...] after the exchange.

Autograd: the exchanges are permutations, so each one's backward is the other. :func:`gather_sequence` (the
model's exit) is an all-gather whose backward is its adjoint, a reduce-scatter: each CP rank's gradient of the
gathered tensor is summed, then the rank keeps its piece. Gradients of parameters are therefore *partial* on
each CP rank, and their sum over the group is the gradient of the sum of the ranks' losses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist


def _parallel_state():
    from megatron.core import parallel_state

    return parallel_state


def cp_group() -> Optional[dist.ProcessGroup]:
    """The context-parallel group, or None when megatron's parallel_state is not initialised or CP = 1."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    state = _parallel_state()
    if not state.model_parallel_is_initialized() or state.get_context_parallel_world_size() == 1:
        return None
    return state.get_context_parallel_group()


def cp_world_size() -> int:
    """Ranks in the context-parallel group (1 without it)."""
    group = cp_group()
    return 1 if group is None else dist.get_world_size(group)


def split_sizes(total: int, parts: int) -> tuple[int, ...]:
    """Tokens of each of ``parts`` ranks for a sequence of ``total``: contiguous, the first ``total % parts``
    one larger; ValueError when some rank would hold none."""
    if total < parts:
        raise ValueError(f"a sequence of {total} tokens cannot be split over {parts} context-parallel ranks")
    base, extra = divmod(total, parts)
    return tuple(base + (1 if r < extra else 0) for r in range(parts))


@dataclass(frozen=True)
class SequenceShards:
    """How one sequence is split over the CP group: rank r holds ``sizes[r]`` consecutive tokens."""

    sizes: tuple[int, ...]
    """Tokens held by each CP rank, in rank order."""
    rank: int
    """This process's rank in the CP group."""
    group: object
    """The CP process group."""

    @classmethod
    def split(cls, total: int, group=None) -> "SequenceShards":
        """The even split of ``total`` tokens over ``group`` (default: the CP group, which must exist)."""
        group = cp_group() if group is None else group
        if group is None:
            raise ValueError("SequenceShards.split needs a context-parallel group")
        return cls(split_sizes(total, dist.get_world_size(group)), dist.get_rank(group), group)

    @property
    def parts(self) -> int:
        """CP degree."""
        return len(self.sizes)

    @property
    def total(self) -> int:
        """Tokens of the whole sequence."""
        return sum(self.sizes)

    @property
    def start(self) -> int:
        """First token of this rank."""
        return sum(self.sizes[:self.rank])

    @property
    def local(self) -> int:
        """Tokens of this rank."""
        return self.sizes[self.rank]

    def joint(self, other: "SequenceShards") -> "SequenceShards":
        """The split of the per-rank concatenation [this rank's piece of self, its piece of other]."""
        if other.parts != self.parts or other.rank != self.rank:
            raise ValueError("joint sequences must be split over the same CP group")
        return SequenceShards(tuple(a + b for a, b in zip(self.sizes, other.sizes)), self.rank, self.group)

    def shard(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's tokens of ``full`` (the whole sequence along ``dim``, the same on every CP rank)."""
        if full.shape[dim] != self.total:
            raise ValueError(f"expected {self.total} tokens along dim {dim}, got {full.shape[dim]}")
        return full.narrow(dim, self.start, self.local)


def _pieces(x: torch.Tensor, sizes: tuple[int, ...], dim: int) -> list[torch.Tensor]:
    return list(x.split(list(sizes), dim=dim))


def _all_gather(local: torch.Tensor, shards: SequenceShards, dim: int) -> torch.Tensor:
    """Concatenate every rank's piece along ``dim`` (pieces padded to the largest, then trimmed)."""
    longest = max(shards.sizes)
    moved = local.movedim(dim, 0)
    padded = moved.new_zeros((longest, *moved.shape[1:]))
    padded[:moved.shape[0]] = moved
    buffers = [torch.empty_like(padded) for _ in shards.sizes]
    dist.all_gather(buffers, padded.contiguous(), group=shards.group)
    return torch.cat([b[:n] for b, n in zip(buffers, shards.sizes)]).movedim(0, dim).contiguous()


class _GatherSequence(torch.autograd.Function):
    """All-gather of sequence pieces; backward: sum the gradients over the group (the adjoint), keep own piece."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, shards: SequenceShards, dim: int) -> torch.Tensor:
        ctx.shards, ctx.dim = shards, dim
        return _all_gather(local, shards, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # An all-reduce then a slice: the gathered tensors are the model's outputs, a latent-sized tensor
        # (small next to the activations), so the 2x volume of all-reduce over reduce-scatter does not matter.
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.shards.group)
        return ctx.shards.shard(total, ctx.dim).contiguous(), None, None


def gather_sequence(local: torch.Tensor, shards: Optional[SequenceShards], dim: int) -> torch.Tensor:
    """The whole sequence from every rank's ``local`` piece along ``dim`` (identity without CP)."""
    if shards is None:
        return local
    if local.shape[dim] != shards.local:
        raise ValueError(f"expected {shards.local} local tokens along dim {dim}, got {local.shape[dim]}")
    return _GatherSequence.apply(local, shards, dim)


def _seq_to_heads(x: torch.Tensor, shards: SequenceShards) -> torch.Tensor:
    """(B, S_r, H, D) → (B, S, H / cp, D): all tokens of this rank's group of heads."""
    b, s_r, h, d = x.shape
    cp = shards.parts
    if h % cp:
        raise ValueError(f"{h} attention heads per rank cannot be split over {cp} context-parallel ranks")
    hc = h // cp
    send = x.reshape(b, s_r, cp, hc, d).permute(2, 0, 1, 3, 4).contiguous().flatten()
    recv_counts = [b * n * hc * d for n in shards.sizes]
    recv = send.new_empty(sum(recv_counts))
    dist.all_to_all_single(recv, send, recv_counts, [b * s_r * hc * d] * cp, group=shards.group)
    pieces = [p.view(b, n, hc, d) for p, n in zip(recv.split(recv_counts), shards.sizes)]
    return torch.cat(pieces, dim=1)


def _heads_to_seq(y: torch.Tensor, shards: SequenceShards) -> torch.Tensor:
    """(B, S, H / cp, D) → (B, S_r, H, D): this rank's tokens with every head (inverse of _seq_to_heads)."""
    b, _, hc, d = y.shape
    cp, s_r = shards.parts, shards.local
    send = torch.cat([p.contiguous().flatten() for p in _pieces(y, shards.sizes, 1)])
    send_counts = [b * n * hc * d for n in shards.sizes]
    recv = send.new_empty(cp * b * s_r * hc * d)
    dist.all_to_all_single(recv, send, [b * s_r * hc * d] * cp, send_counts, group=shards.group)
    return recv.view(cp, b, s_r, hc, d).permute(1, 2, 0, 3, 4).reshape(b, s_r, cp * hc, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, shards: SequenceShards) -> torch.Tensor:
        ctx.shards = shards
        return _seq_to_heads(x, shards)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _heads_to_seq(grad, ctx.shards), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, shards: SequenceShards) -> torch.Tensor:
        ctx.shards = shards
        return _heads_to_seq(y, shards)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _seq_to_heads(grad, ctx.shards), None


AttentionKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def attend(kernel: AttentionKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           shards: Optional[SequenceShards] = None, *, key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``kernel(q, k, v)`` over the whole sequence: (B, S_r, H, D) x3 → (B, S_r, H * D).

    Without ``shards`` the kernel runs on the given tokens (self-attention without CP, or cross-attention:
    local queries against the full text). With them, q, k and v hold this rank's tokens and the kernel sees
    every token of H / cp heads (Ulysses). ``key_mask`` (B, S_keys) bool, True = attend, marks the keys every
    query may see, in the order the kernel sees them: the given keys without CP, the gathered order with it
    (:func:`gathered_order`).
    """
    mask = None if key_mask is None else key_mask[:, None, None, :]
    if shards is None or shards.parts == 1:
        return kernel(q, k, v) if mask is None else kernel(q, k, v, attn_mask=mask)
    full = [_SeqToHeads.apply(t, shards) for t in (q, k, v)]
    out = kernel(*full) if mask is None else kernel(*full, attn_mask=mask)
    b, s, hc, d = full[0].shape
    return _HeadsToSeq.apply(out.view(b, s, hc, d), shards).flatten(2)


def gathered_order(streams: list[tuple[torch.Tensor, Optional[SequenceShards]]], dim: int) -> torch.Tensor:
    """The whole joint sequence of several streams in the order attention sees its keys.

    Each stream is (the whole stream, its split over the CP group or None). Without CP the order is the streams
    one after the other; with it each rank holds [its piece of stream 0, of stream 1, ...] and Ulysses gathers
    the ranks in order, so the keys are rank 0's pieces, then rank 1's, ... (module doc).
    """
    if all(shards is None for _, shards in streams):
        return torch.cat([full for full, _ in streams], dim=dim)
    parts = streams[0][1].parts
    pieces = [list(full.split(list(shards.sizes), dim=dim)) for full, shards in streams]
    return torch.cat([stream[r] for r in range(parts) for stream in pieces], dim=dim)
