"""The Mamba2 mixer over state slots of the KV cache.

A slot holds the conv state (the last d_conv - 1 pre-conv inputs xBC, [d_conv - 1, conv_dim], oldest first)
and the ssm state ([heads, head_dim, d_state], in the model's dtype). A prefill chunk starts from the sequence's slot
(zeros when num_computed == 0: a slot may hold a previous owner's state), writes the states the scheduler
asked for (`mamba_saves`) and its final state back to the slot.

Every step's rows run through one compiled kernel (fused_mamba.py), token by token over each sequence. The conv
state is float32 in either model dtype (a bfloat16 model's holds its bfloat16 inputs exactly, at ~3% of a slot's
bytes; the kernel takes the projection's output widened to float32); a bfloat16 model's SSM state is bfloat16,
computed in float32 and rounded once per step where it is stored. The tests hold the kernel to the formulas in
float64 and the model to transformers.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridpd.engine.kv_cache.storage import KVCacheStorage
from hybridpd.engine.model.kernels.fused_mamba import MambaKernelCaches, MambaKernelWeights, mamba_rows_
from hybridpd.engine.model.shapes import Mamba2Shape, MambaNorm
from hybridpd.engine.model.kernels.linear import linear
from hybridpd.engine.model.step.context import StepContext
from hybridpd.engine.model.step.mamba_meta import MambaRows


class Mamba2Mixer(nn.Module):
    def __init__(self, shape: Mamba2Shape, cache_id: int, dtype: torch.dtype) -> None:
        """`cache_id`: this layer's entry in the KV cache (its layer id, or any id unique among the model's caches)."""
        super().__init__()
        self.layer_id = cache_id
        self.heads = shape.n_heads
        self.head_dim = shape.d_head
        self.groups = shape.n_groups
        self.d_state = shape.d_state
        self.d_conv = shape.d_conv
        self.intermediate = shape.intermediate_size
        self.conv_dim = shape.conv_dim
        self.dt_min, self.dt_max = shape.time_step_limit
        self.in_proj = nn.Linear(
            shape.hidden_size, self.intermediate + self.conv_dim + self.heads, bias=shape.in_proj_bias, dtype=dtype,
        )
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, kernel_size=self.d_conv, groups=self.conv_dim,
            bias=shape.conv_bias, padding=self.d_conv - 1, dtype=dtype,
        )
        # in_proj's outputs scaled per part (z, x, B, C, dt) where the family says so, else None (no op).
        self._in_proj_scale = _part_scale(shape, dtype)
        # The conv weight lives in a [K, C] buffer and conv1d.weight ([C, 1, K], the checkpoint's name and shape) is
        # a view of it: loading a state dict copies into the view, so the buffer can never go stale. The kernel
        # multiplies rows of C channels by weight[k], contiguous in this layout.
        self.register_buffer("conv_weight", self.conv1d.weight.detach()[:, 0, :].T.contiguous(), persistent=False)
        self.conv1d.weight = nn.Parameter(self.conv_weight.T[:, None, :], requires_grad=False)
        self.dt_bias = nn.Parameter(torch.ones(self.heads, dtype=dtype))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, self.heads + 1, dtype=torch.float32)).to(dtype))
        self.D = nn.Parameter(torch.ones(self.heads, dtype=dtype))
        # transformers' `norm` (its weight in the checkpoint) unless y meets the gate without one
        self.norm_mode = shape.norm
        self.norm_group, self.norm_eps = self.intermediate // self.groups, shape.norm_eps
        if shape.norm is not MambaNorm.GATE_ONLY:
            self.norm = GateNormWeight(self.intermediate, dtype)
        self._unit_norm_weight = torch.ones(self.intermediate, dtype=torch.float32)  # the kernel's, without a norm
        self.out_proj = nn.Linear(self.intermediate, shape.hidden_size, bias=shape.out_proj_bias, dtype=dtype)
        # The kernel's conv bias when the layer has none (zeros: the same sums).
        self._zero_bias = torch.zeros(self.conv_dim, dtype=torch.float32)
        self._kernel_weights_of: tuple[torch.Tensor, ...] = ()   # held: an id is never reused
        self._kernel_versions: list[int] = []
        self._kernel_weights: MambaKernelWeights | None = None
        self._kernel_caches_of: tuple[torch.Tensor, ...] = ()
        self._kernel_caches: MambaKernelCaches | None = None

    def _constants(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A = -exp(A_log), D and dt_bias, in float32: computed when the kernel's weights are made again
        (`_weights_for_kernel` checks the parameters they come from, these three included)."""
        return -torch.exp(self.A_log.float()), self.D.float(), self.dt_bias.float()

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.d_conv - 1, self.conv_dim)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        return (self.heads, self.head_dim, self.d_state)

    def forward(self, x: torch.Tensor, ctx: StepContext, kv: KVCacheStorage) -> torch.Tensor:
        """A step through the compiled kernel (fused_mamba.py), in float32 (a bfloat16 model's projection widened
        where the kernel reads it, the result rounded back): in_proj, the convolution, state updates, read-out and
        gated norm, row by row (the states updated where they sit and saved where asked), out_proj."""
        meta = ctx.groups[kv.slot(self.layer_id).group_id]
        if not isinstance(meta, MambaRows):
            raise TypeError(f"layer {self.layer_id} is Mamba but its KV group is not")
        conv_cache, ssm_cache = kv.mamba_views(self.layer_id)
        y = mamba_rows_(self._in_proj(x), meta, self._caches_for_kernel(conv_cache, ssm_cache),
                        self._weights_for_kernel())
        return linear(y, self.out_proj.weight, self.out_proj.bias)   # y in x's dtype: the kernel writes it so

    def _kernel_sources(self) -> tuple[torch.Tensor, ...]:
        """The tensors the kernel's weights are made from, as the module holds them now: the conv weight and bias,
        A_log, D, dt_bias and the norm's weight. Read through nn.Module's dicts: its attribute lookup costs ~0.5 us a
        name, and every Mamba layer makes this check at every step."""
        params, modules = self._parameters, self._modules
        bias = modules["conv1d"]._parameters["bias"]
        norm = modules.get("norm")
        return (self._buffers["conv_weight"], self._zero_bias if bias is None else bias, params["A_log"], params["D"],
                params["dt_bias"], self._unit_norm_weight if norm is None else norm._parameters["weight"])

    def _weights_for_kernel(self) -> MambaKernelWeights:
        """The kernel's numpy views of the parameters (of float32 copies in a bfloat16 model, of A = -exp(A_log)),
        made again only when a tensor they come from was replaced (a reloaded constant, a new Parameter) or written
        in place."""
        sources = self._kernel_sources()
        versions = [t._version for t in sources]
        if (self._kernel_weights is None or versions != self._kernel_versions
                or any(a is not b for a, b in zip(sources, self._kernel_weights_of))):
            A, D, dt_bias = self._constants()
            conv_weight, bias, norm_weight = (t.float() for t in (sources[0], sources[1], sources[5]))
            self._kernel_weights = MambaKernelWeights.of(
                conv_weight, bias, dt_bias, A, D, (self.dt_min, self.dt_max), norm_weight,
                self.norm_group, self.norm_eps, self.groups, self.norm_mode,
            )
            self._kernel_weights_of, self._kernel_versions = sources, versions
        return self._kernel_weights

    def _caches_for_kernel(self, conv_cache: torch.Tensor, ssm_cache: torch.Tensor) -> MambaKernelCaches:
        held = self._kernel_caches_of
        if self._kernel_caches is None or held[0] is not conv_cache or held[1] is not ssm_cache:
            self._kernel_caches = MambaKernelCaches.of(conv_cache, ssm_cache)
            self._kernel_caches_of = (conv_cache, ssm_cache)
        return self._kernel_caches

    def _in_proj(self, x: torch.Tensor) -> torch.Tensor:
        """in_proj -> its whole output [T, I + C + H] (gate | xbc | dt_raw), which the kernel reads where it lies.

        One product: the gate used to come from a product of its own on a prefill's rows (torch's SiLU over a
        contiguous gate ran ~3x faster); the kernel now takes the gate's SiLU where it reads it, and the one product
        was as fast as two (a 512-token float32 prefill of granite-350m, one engine, alternated: 0.986 of the two's
        time; the small preset's 1,024 tokens 0.995)."""
        proj = linear(x, self.in_proj.weight, self.in_proj.bias)
        if self._in_proj_scale is not None:
            proj.mul_(self._in_proj_scale)
        return proj


class GateNormWeight(nn.Module):
    """transformers' gated RMSNorm as the checkpoint names it (`norm.weight`); the kernel applies it, per group of
    channels, before or after the gate as `norm_mode` says."""

    def __init__(self, size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))


def _part_scale(shape: Mamba2Shape, dtype: torch.dtype) -> torch.Tensor | None:
    """[I + conv_dim + H]: each in_proj output's multiplier (gate z, x, B, C, dt), or None when all are 1."""
    if all(m == 1.0 for m in shape.in_proj_multipliers):
        return None
    state = shape.n_groups * shape.d_state
    sizes = (shape.intermediate_size, shape.intermediate_size, state, state, shape.n_heads)
    parts = [torch.full((n,), m, dtype=torch.float32) for n, m in zip(sizes, shape.in_proj_multipliers)]
    return torch.cat(parts).to(dtype)
