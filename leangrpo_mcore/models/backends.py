"""Layer backends: the one place that names Transformer Engine.

A backend provider builds the linears and the core attention of a model, in the style of
megatron-core's ``LocalSpecProvider`` / ``TESpecProvider``: the model asks for "a column-parallel linear"
and the provider fills the slot with megatron's local ``ColumnParallelLinear`` or TE's ``Linear``.
Whatever the backend:

- every linear's ``forward(x)`` returns a Tensor (never megatron's ``(out, bias)`` tuple) and accepts any
  number of leading dimensions;
- parameters are named ``weight`` / ``bias`` and partitioned ones carry megatron's TP attributes, so one
  checkpoint and one converter serve both backends;
- every linear has ``parallel_mode`` in {"column", "row", "replicated"} and ``full_in_features`` /
  ``full_out_features`` (the unsharded sizes), and can host LoRA adapters;
- a column-parallel linear may apply its activation itself (``activation="gelu_tanh"``), after the adapters,
  so that the bias is fused where the backend can (see :func:`activate`).

``core_attention`` modules take q, k, v of shape (B, S, heads_local, head_dim) and an optional boolean
``attn_mask`` broadcastable to (B, heads, S_q, S_k) with True = attend (torch SDPA convention), and
return (B, S, heads_local * head_dim).

Backend choice (:func:`resolve_backend`): ``auto`` is TE when ``import transformer_engine.pytorch``
succeeds (any exception counts as absent: a broken TE raises RuntimeError/OSError, not only
ImportError) and CUDA is available, else ``local``.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from leangrpo_mcore.mcore_import import import_megatron_core

import_megatron_core()  # megatron-core's first import, without torch's compiler and wandb (see mcore_import)

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

from leangrpo_mcore.models.common.context_parallel import cp_world_size
from leangrpo_mcore.models.common.fp8 import fp8_alignment
from leangrpo_mcore.models.common.init import set_init, uniform_fan_in
from leangrpo_mcore.models.common.lora import AdapterHostMixin
from leangrpo_mcore.models.common.tp import divide, mark_tp_partitioned, tp_group, tp_world_size

BACKENDS = ("auto", "local", "te")
"""TE's FP8 GEMMs need both matrix dimensions of the input to be multiples of 16."""


@functools.lru_cache(maxsize=1)
def _import_te():
    try:
        import transformer_engine.pytorch as te
    except Exception:  # noqa: BLE001 - a broken TE install raises RuntimeError/OSError, not ImportError
        return None
    return te


def te_available() -> bool:
    """True when Transformer Engine imports and CUDA is available."""
    return _import_te() is not None and torch.cuda.is_available()


def resolve_backend(name: str = "auto") -> str:
    """Map ``auto`` / ``local`` / ``te`` to the backend that will be used ("local" or "te")."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "auto":
        return "te" if te_available() else "local"
    if name == "te" and not te_available():
        raise ValueError("backend 'te' requested but Transformer Engine does not import or CUDA is unavailable")
    return name


ACTIVATIONS = (None, "gelu_tanh")


def activate(out: torch.Tensor, activation: Optional[str], bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``activation(out + bias)``; ``bias`` is given when the linear left it out of its GEMM.

    megatron's linear autograd function (TP > 1) adds a bias as a separate op and sums its gradient separately;
    megatron-core's own MLP instead takes the bias out (``skip_bias_add``) and fuses it into the activation
    (``bias_gelu_impl``: one kernel forward, one backward, the bias gradient from the same pass). That fusion is
    a ``torch.compile``d kernel: used on CUDA, while on the CPU (where compiling costs tens of seconds per
    process and fuses nothing that matters) the same formula runs eagerly.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; choose one of {ACTIVATIONS}")
    if activation is None:
        return out if bias is None else out + bias
    if bias is not None and out.is_cuda:
        from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl

        return bias_gelu_impl(out, bias)
    return F.gelu(out if bias is None else out + bias, approximate="tanh")


def _init_linear_params(module: torch.nn.Module, in_features: int, out_features: int, mode: str) -> None:
    # Alone in its TP group (or without megatron's parallel state) a parallel linear needs no collective, and
    # megatron's autograd function would only split the fused matmul-plus-bias into a matmul, a separate bias
    # add and a separate bias-gradient sum: such linears call F.linear (one addmm) instead.
    module.tp_alone = tp_world_size() == 1
    module.parallel_mode = mode
    module.full_in_features = in_features
    module.full_out_features = out_features
    set_init(module.weight, uniform_fan_in(in_features))
    bias = getattr(module, "bias", None)
    if isinstance(bias, torch.nn.Parameter):
        set_init(bias, uniform_fan_in(in_features))


class ReplicatedLinear(torch.nn.Module, AdapterHostMixin):
    """A full linear on every TP rank (adaLN modulation, embeddings, final projection)."""

    def __init__(self, in_features: int, out_features: int, *, config: TransformerConfig, bias: bool = True) -> None:
        super().__init__()
        dtype = config.params_dtype
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        _init_linear_params(self, in_features, out_features, "replicated")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T + b`` plus the adapter term."""
        return self.add_adapter_output(x, F.linear(x, self.weight, self.bias))


def _flat_call(base_forward, x: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    # megatron's linear autograd functions compute weight/bias gradients on 2-D or 3-D inputs only;
    # flattening the leading dimensions makes every input rank safe.
    out, bias = base_forward(x.reshape(-1, x.shape[-1]))
    return out.view(*x.shape[:-1], out.shape[-1]), bias


class LocalColumnParallelLinear(ColumnParallelLinear, AdapterHostMixin):
    """megatron ColumnParallelLinear (output sharded over TP, never gathered) returning a Tensor, optionally
    activated (the bias then goes into the activation at TP > 1: see :func:`activate`)."""

    def __init__(self, in_features: int, out_features: int, *, config: TransformerConfig, bias: bool = True,
                 activation: Optional[str] = None) -> None:
        super().__init__(in_features, out_features, config=config, init_method=config.init_method,
                         bias=bias, gather_output=False, skip_bias_add=bias and activation is not None,
                         tp_group=tp_group())
        self.activation = activation
        # megatron sets the weight's TP attributes only when it initialises the weight itself.
        mark_tp_partitioned(self.weight, 0)
        _init_linear_params(self, in_features, out_features, "column")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Base output plus the adapter term (see the class doc), activated."""
        if self.tp_alone:  # the bias is fused into the GEMM (addmm)
            return activate(self.add_adapter_output(x, F.linear(x, self.weight, self.bias)), self.activation)
        out, bias = _flat_call(super().forward, x)
        if bias is not None and not out.is_cuda:
            # Nothing to fuse on the CPU: add the bias before the adapters, the order of the TP=1 path, so that
            # TP sizes differ by the GEMMs' rounding only.
            out, bias = out + bias, None
        return activate(self.add_adapter_output(x, out), self.activation, bias)


class LocalRowParallelLinear(RowParallelLinear, AdapterHostMixin):
    """megatron RowParallelLinear (input sharded, output all-reduced, bias added once) returning a Tensor."""

    def __init__(self, in_features: int, out_features: int, *, config: TransformerConfig, bias: bool = True) -> None:
        super().__init__(in_features, out_features, config=config, init_method=config.init_method,
                         bias=bias, input_is_parallel=True, skip_bias_add=False, tp_group=tp_group())
        mark_tp_partitioned(self.weight, 1)
        _init_linear_params(self, in_features, out_features, "row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Base output plus the adapter term (see the class doc)."""
        if self.tp_alone:
            out = F.linear(x, self.weight, self.bias)
        else:
            out = _flat_call(super().forward, x)[0]
        return self.add_adapter_output(x, out)


class SDPACoreAttention(torch.nn.Module):
    """Non-causal attention through ``torch.nn.functional.scaled_dot_product_attention``.

    fp32 inputs stay fp32 (torch picks a kernel that supports fp32); no dropout.
    """

    def __init__(self, *, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(B, S, H, D) x3 -> (B, S_q, H * D)."""
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=attn_mask, dropout_p=0.0, is_causal=False)
        return out.transpose(1, 2).flatten(2)


class BackendProvider:
    """Builds the layer slots of a model; subclasses fill them with one implementation."""

    name = "abstract"

    def column_parallel_linear(self, in_features: int, out_features: int, *, config: TransformerConfig,
                               bias: bool = True, activation: Optional[str] = None) -> torch.nn.Module:
        """Linear whose output features are sharded over TP, followed by ``activation`` (see :func:`activate`)."""
        raise NotImplementedError

    def row_parallel_linear(self, in_features: int, out_features: int, *, config: TransformerConfig,
                            bias: bool = True) -> torch.nn.Module:
        """Linear whose input features are sharded over TP; output all-reduced, bias added once."""
        raise NotImplementedError

    def replicated_linear(self, in_features: int, out_features: int, *, config: TransformerConfig,
                          bias: bool = True) -> torch.nn.Module:
        """Linear with the full weight on every TP rank."""
        return ReplicatedLinear(in_features, out_features, config=config, bias=bias)

    def core_attention(self, *, config: TransformerConfig, num_heads: Optional[int] = None,
                       head_dim: Optional[int] = None) -> torch.nn.Module:
        """Attention over this rank's heads (defaults: config.num_attention_heads, config.kv_channels)."""
        raise NotImplementedError

    @staticmethod
    def _heads(config, num_heads: Optional[int], head_dim: Optional[int]) -> tuple[int, int]:
        heads = config.num_attention_heads if num_heads is None else num_heads
        dim = config.kv_channels if head_dim is None else head_dim
        return heads, dim


class LocalBackend(BackendProvider):
    """megatron-core ``tensor_parallel`` linears and torch SDPA: runs everywhere, including the CPU."""

    name = "local"

    def column_parallel_linear(self, in_features: int, out_features: int, *, config: TransformerConfig,
                               bias: bool = True, activation: Optional[str] = None) -> torch.nn.Module:
        """See :meth:`BackendProvider.column_parallel_linear`."""
        return LocalColumnParallelLinear(in_features, out_features, config=config, bias=bias, activation=activation)

    def row_parallel_linear(self, in_features: int, out_features: int, *, config: TransformerConfig,
                            bias: bool = True) -> torch.nn.Module:
        """See :meth:`BackendProvider.row_parallel_linear`."""
        return LocalRowParallelLinear(in_features, out_features, config=config, bias=bias)

    def core_attention(self, *, config: TransformerConfig, num_heads: Optional[int] = None,
                       head_dim: Optional[int] = None) -> torch.nn.Module:
        """See :meth:`BackendProvider.core_attention`."""
        heads, dim = self._heads(config, num_heads, head_dim)
        # Under context parallelism (Ulysses) the kernel sees 1 / cp of this rank's heads.
        return SDPACoreAttention(num_heads=divide(heads, tp_world_size() * cp_world_size()), head_dim=dim)


_WEIGHTS_VERSION = [0]


def weights_version() -> int:
    """How many optimizer steps have changed the weights in this process (FP8 weight caches key on it)."""
    return _WEIGHTS_VERSION[0]


def weights_changed() -> None:
    """Call after every optimizer step: cached FP8 copies of the weights are stale from now on."""
    _WEIGHTS_VERSION[0] += 1


@functools.lru_cache(maxsize=1)
def _te_classes():
    te = _import_te()
    if te is None:
        raise ValueError("Transformer Engine is not importable")

    class TELinear(te.Linear, AdapterHostMixin):
        """TE ``Linear`` (column / row / no parallel mode) returning a Tensor, with LoRA slots."""

        def __init__(self, in_features: int, out_features: int, *, config: TransformerConfig, bias: bool,
                     mode: str, activation: Optional[str] = None) -> None:
            parallel = mode in ("column", "row")
            super().__init__(
                in_features, out_features, bias=bias, init_method=torch.nn.init.zeros_,
                tp_group=tp_group() if parallel else None, tp_size=tp_world_size() if parallel else 1,
                parallel_mode=mode if parallel else None, sequence_parallel=False,
                params_dtype=config.params_dtype,
                # A policy built on the meta device (sharded materialisation) stays there until to_empty.
                device="meta" if torch.empty(0).is_meta else "cuda",
            )
            self.activation = activation
            self.fp8_align = fp8_alignment(getattr(config, "fp8_recipe", None))
            self._quantised_version = -1
            # TE sets megatron's TP attributes itself; restating them keeps every backend identical.
            if mode == "column":
                mark_tp_partitioned(self.weight, 0)
                if bias:
                    mark_tp_partitioned(self.bias, 0)
            elif mode == "row":
                mark_tp_partitioned(self.weight, 1)
            _init_linear_params(self, in_features, out_features, mode)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            """Base output plus the adapter term (see the class doc)."""
            x = x.contiguous()
            rows, align = x.numel() // x.shape[-1], self.fp8_align
            if rows % align or x.shape[-1] % align or self.weight.shape[0] % align or self.weight.shape[1] % align:
                # FP8 GEMMs need every dimension of both operands aligned (16; MXFP8: 32); per-sample
                # projections (adaLN modulation, the timestep / pooled-text embedders at small batch) and odd
                # weight shapes run unquantised instead of failing.
                with te.fp8_autocast(enabled=False):
                    out = super().forward(x)
            else:
                # The weights change only at an optimizer step: quantise them at the first forward after one
                # and reuse TE's cached FP8 copy for the T x M rollout forwards and the training forwards
                # until the next step.
                version = weights_version()
                first, self._quantised_version = self._quantised_version != version, version
                out = super().forward(x, is_first_microbatch=first)
            return activate(self.add_adapter_output(x, out), self.activation)

    class TECoreAttention(torch.nn.Module):
        """TE ``DotProductAttention`` in "bshd" layout; picks flash / fused / unfused kernels itself."""

        def __init__(self, *, num_heads: int, head_dim: int) -> None:
            super().__init__()
            self.attn = te.DotProductAttention(
                num_attention_heads=num_heads, kv_channels=head_dim, attention_dropout=0.0,
                qkv_format="bshd", attn_mask_type="no_mask", tp_size=tp_world_size(), tp_group=tp_group(),
            )

        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
            """(B, S, H, D) x3 -> (B, S_q, H * D); ``attn_mask`` True = attend."""
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            if attn_mask is None:
                return self.attn(q, k, v)
            # TE's arbitrary masks mark the positions to drop, the opposite of torch SDPA.
            return self.attn(q, k, v, attention_mask=~attn_mask.bool(), attn_mask_type="arbitrary")

    return TELinear, TECoreAttention


class TEBackend(BackendProvider):
    """Transformer Engine linears (FP8-capable) and fused attention; needs CUDA."""

    name = "te"

    def column_parallel_linear(self, in_features: int, out_features: int, *, config: TransformerConfig,
                               bias: bool = True, activation: Optional[str] = None) -> torch.nn.Module:
        """See :meth:`BackendProvider.column_parallel_linear` (TE fuses the bias into its GEMMs itself)."""
        return _te_classes()[0](in_features, out_features, config=config, bias=bias, mode="column",
                                activation=activation)

    def row_parallel_linear(self, in_features: int, out_features: int, *, config: TransformerConfig,
                            bias: bool = True) -> torch.nn.Module:
        """See :meth:`BackendProvider.row_parallel_linear`."""
        return _te_classes()[0](in_features, out_features, config=config, bias=bias, mode="row")

    def replicated_linear(self, in_features: int, out_features: int, *, config: TransformerConfig,
                          bias: bool = True) -> torch.nn.Module:
        """See :meth:`BackendProvider.replicated_linear`."""
        return _te_classes()[0](in_features, out_features, config=config, bias=bias, mode="replicated")

    def core_attention(self, *, config: TransformerConfig, num_heads: Optional[int] = None,
                       head_dim: Optional[int] = None) -> torch.nn.Module:
        """See :meth:`BackendProvider.core_attention`."""
        heads, dim = self._heads(config, num_heads, head_dim)
        # TE divides by the TP size itself; under context parallelism (Ulysses) it sees 1 / cp of the heads.
        return _te_classes()[1](num_heads=divide(heads, cp_world_size()), head_dim=dim)


def get_backend(name: str = "auto") -> BackendProvider:
    """The provider for ``name`` in {"auto", "local", "te"} (see :func:`resolve_backend`)."""
    return TEBackend() if resolve_backend(name) == "te" else LocalBackend()
