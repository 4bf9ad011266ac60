"""The Mamba2 mixer over state slots of the KV cache.

A slot holds the conv state (the last d_conv - 1 pre-conv inputs xBC, [d_conv - 1, conv_dim], oldest first)
and the ssm state ([heads, head_dim, d_state], float32). A prefill chunk starts from the sequence's slot
(zeros when num_computed == 0: a slot may hold a previous owner's state), writes the states the scheduler
asked for (`mamba_saves`) and its final state back to the slot.

Every step's rows run through one compiled kernel (fused_mamba.py) when the slots' states are float32, which the
model's cache specs make them in either dtype (a bfloat16 model's conv state holds bfloat16 values exactly, at ~3%
of a slot's bytes; the kernel takes the projection's output widened to float32): token by token over each
sequence, the states updated where they sit in the cache. Caches of other dtypes take the torch path: decode rows
(one new token, num_computed > 0) one batched recurrent step, the other sequences one batched convolution and
chunked scan (ssd.py); the tests hold the kernel to it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hybridpd.engine.kv_cache.storage import KVCacheStorage
from hybridpd.engine.model.kernels.fused_mamba import MambaKernelCaches, MambaKernelWeights, mamba_rows_
from hybridpd.engine.model.layers.norms import GatedRMSNorm
from hybridpd.engine.model.shapes import Mamba2Shape, MambaNorm
from hybridpd.engine.model.kernels.linear import linear
from hybridpd.engine.model.kernels.ssd import chunked_scan, recurrent_step_
from hybridpd.engine.model.step.mamba_layout import MambaPrefillLayout
from hybridpd.engine.model.step.context import StepContext
from hybridpd.engine.model.step.mamba_meta import MambaDecode, MambaGroupMeta, MambaRows


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
        self.chunk_size = shape.chunk_size
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
        # a view of it: loading a state dict copies into the view, so the buffer can never go stale. Both the
        # decode and prefill convolutions multiply rows of C channels by weight[k]: a contiguous row is ~3x faster
        # than the strided column weight[:, 0, k].
        self.register_buffer("conv_weight", self.conv1d.weight.detach()[:, 0, :].T.contiguous(), persistent=False)
        self.conv1d.weight = nn.Parameter(self.conv_weight.T[:, None, :], requires_grad=False)
        self.dt_bias = nn.Parameter(torch.ones(self.heads, dtype=dtype))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, self.heads + 1, dtype=torch.float32)).to(dtype))
        self.D = nn.Parameter(torch.ones(self.heads, dtype=dtype))
        # transformers' `norm` (its weight in the checkpoint) unless y meets the gate without one
        self.norm_mode = shape.norm
        self.norm_group, self.norm_eps = self.intermediate // self.groups, shape.norm_eps
        if shape.norm is not MambaNorm.GATE_ONLY:
            self.norm = GatedRMSNorm(self.intermediate, self.norm_group, shape.norm_eps, dtype,
                                     norm_first=shape.norm is MambaNorm.NORM_THEN_GATE)
        self._unit_norm_weight = torch.ones(self.intermediate, dtype=torch.float32)  # the kernel's, without a norm
        self.out_proj = nn.Linear(self.intermediate, shape.hidden_size, bias=shape.out_proj_bias, dtype=dtype)
        # The kernel's conv bias when the layer has none (zeros: the same sums).
        self._zero_bias = torch.zeros(self.conv_dim, dtype=torch.float32)
        self._constants_of: tuple[torch.Tensor, ...] = ()
        self._constants_versions: tuple[int, ...] = ()
        self._constants_value: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = ()  # type: ignore[assignment]
        self._kernel_weights_of: tuple[tuple[torch.Tensor, int], ...] = ()
        self._kernel_weights: MambaKernelWeights | None = None
        self._kernel_caches_of: tuple[torch.Tensor, ...] = ()
        self._kernel_caches: MambaKernelCaches | None = None

    def _constants(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A = -exp(A_log), D and dt_bias, in float32: computed again only when a parameter was replaced or written
        (a reloaded checkpoint), else taken as they were (three ops fewer per layer and step)."""
        params = (self.A_log, self.D, self.dt_bias)
        versions = tuple(p._version for p in params)
        held = self._constants_of
        if versions != self._constants_versions or any(a is not b for a, b in zip(params, held)):
            self._constants_value = (-torch.exp(self.A_log.float()), self.D.float(), self.dt_bias.float())
            self._constants_of, self._constants_versions = params, versions  # held: an id is never reused
        return self._constants_value

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.d_conv - 1, self.conv_dim)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        return (self.heads, self.head_dim, self.d_state)

    def forward(self, x: torch.Tensor, ctx: StepContext, kv: KVCacheStorage) -> torch.Tensor:
        meta = ctx.groups[kv.slot(self.layer_id).group_id]
        if not isinstance(meta, MambaGroupMeta):
            raise TypeError(f"layer {self.layer_id} is Mamba but its KV group is not")
        conv_cache, ssm_cache = kv.mamba_views(self.layer_id)
        if meta.rows is not None:
            return self._forward_fused(x, meta.rows, conv_cache, ssm_cache)
        gate, xbc, dt_raw = self._project(x, separate_gate=meta.prefill is not None)
        A, D, dt_bias = self._constants()
        dt = F.softplus(dt_raw.float() + dt_bias)
        if self.dt_min > 0 or self.dt_max < math.inf:  # softplus is >= 0: the default limit (0, inf) is a no-op
            dt = dt.clamp_(self.dt_min, self.dt_max)
        if meta.prefill is None and meta.decode is not None:  # only decode rows: all of them, in order
            y = self._decode(meta.decode, xbc, dt, A, D, conv_cache, ssm_cache)
            return self._out(y, gate, x.dtype)
        y = torch.empty(x.shape[0], self.intermediate, dtype=torch.float32)
        if meta.decode is not None:
            d = meta.decode
            y[d.rows] = self._decode(d, xbc[d.rows], dt[d.rows], A, D, conv_cache, ssm_cache)
        if meta.prefill is not None:
            self._prefill(meta.prefill, xbc, dt, A, D, y, conv_cache, ssm_cache)
        return self._out(y, gate, x.dtype)

    def _forward_fused(
        self, x: torch.Tensor, rows: MambaRows, conv_cache: torch.Tensor, ssm_cache: torch.Tensor
    ) -> torch.Tensor:
        """A step through the compiled kernels (fused_mamba.py), in float32 (a bfloat16 model's projections widened
        to it, the result rounded back): in_proj, the convolution, state updates, read-out and gated norm, row by row
        (the states updated where they sit and saved where asked), out_proj."""
        gate, xbc_dt = self._in_proj(x, separate_gate=x.shape[0] >= self.SEPARATE_GATE_FROM_ROWS)
        if x.dtype != torch.float32:  # a bfloat16 model: the kernel computes in float32 from the projection's values
            gate, xbc_dt = gate.float(), xbc_dt.float()
        y = mamba_rows_(gate, xbc_dt, rows, self._caches_for_kernel(conv_cache, ssm_cache),
                        self._weights_for_kernel())
        return linear(y.to(x.dtype), self.out_proj.weight, self.out_proj.bias)

    # From this many rows (a prefill chunk) the kernel path takes the gate apart (`_in_proj`): its SiLU then runs in
    # place (~40% faster than over the strided columns of one output), and the two products together take less
    # than the one 580-wide product of the default preset (9.0 vs 10.4 ms on 4,096 rows, MKL).
    SEPARATE_GATE_FROM_ROWS = 256

    def _weights_for_kernel(self) -> MambaKernelWeights:
        """The kernel's numpy views of the parameters (of float32 copies in a bfloat16 model), made again only when a
        tensor they come from was replaced (a reloaded constant, a new Parameter) or, for a copy, written in place;
        in-place loads write through the views of a float32 model."""
        A, D, dt_bias = self._constants()
        bias = self._zero_bias if self.conv1d.bias is None else self.conv1d.bias
        norm_weight = self._unit_norm_weight if self.norm_mode is MambaNorm.GATE_ONLY else self.norm.weight
        tensors = (self.conv_weight, bias, dt_bias, A, D, norm_weight)
        held = tuple((t, t._version if t.dtype != torch.float32 else 0) for t in tensors)
        stale = any(a is not b or u != v for (a, u), (b, v) in zip(held, self._kernel_weights_of))
        if self._kernel_weights is None or stale:
            conv_weight, bias, norm_weight = (t.float() for t in (self.conv_weight, bias, norm_weight))
            self._kernel_weights = MambaKernelWeights.of(
                conv_weight, bias, dt_bias, A, D, (self.dt_min, self.dt_max), norm_weight,
                self.norm_group, self.norm_eps, self.groups, self.norm_mode,
            )
            self._kernel_weights_of = held
        return self._kernel_weights

    def _caches_for_kernel(self, conv_cache: torch.Tensor, ssm_cache: torch.Tensor) -> MambaKernelCaches:
        held = self._kernel_caches_of
        if self._kernel_caches is None or held[0] is not conv_cache or held[1] is not ssm_cache:
            self._kernel_caches = MambaKernelCaches.of(conv_cache, ssm_cache)
            self._kernel_caches_of = (conv_cache, ssm_cache)
        return self._kernel_caches

    def _out(self, y: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Gated norm (or the gate alone), then out_proj (as plain functions: module calls cost a few us each in a
        decode step)."""
        if self.norm_mode is MambaNorm.GATE_ONLY:
            gated = F.silu(gate.float()).mul_(y).to(dtype)
        else:
            gated = self.norm.forward(y, gate).to(dtype)
        return linear(gated, self.out_proj.weight, self.out_proj.bias)

    def _project(self, x: torch.Tensor, separate_gate: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """in_proj -> gate [T, I], xbc [T, conv_dim], dt_raw [T, H] (views; see `_in_proj`)."""
        gate, xbc_dt = self._in_proj(x, separate_gate)
        return gate, *xbc_dt[:, -(self.conv_dim + self.heads) :].split([self.conv_dim, self.heads], dim=-1)

    def _in_proj(self, x: torch.Tensor, separate_gate: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """in_proj -> (gate [T, I], an array whose last conv_dim + H columns are xbc | dt_raw).

        With `separate_gate` the gate comes from its own product (rows [0, I) of the weight, a view) and xbc | dt_raw
        from another: both contiguous, and the silu over the gate runs ~3x faster than over a strided column block
        of the fused output, which on a prefill is worth more than the one extra matmul call. Decode rows take the
        one fused product (the second array is then the whole output), where the call count is what matters."""
        weight, bias, scale = self.in_proj.weight, self.in_proj.bias, self._in_proj_scale
        i = self.intermediate
        if not separate_gate:
            proj = linear(x, weight, bias)
            if scale is not None:
                proj.mul_(scale)
            return proj[:, :i], proj
        gate = linear(x, weight[:i], None if bias is None else bias[:i])
        rest = linear(x, weight[i:], None if bias is None else bias[i:])
        if scale is not None:
            gate.mul_(scale[:i])
            rest.mul_(scale[i:])
        return gate, rest

    def _split_xbc(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[..., conv_dim] -> x [..., H, P], B and C [..., G, N] per group (views)."""
        xs, B, C = conv_out.float().split(
            [self.intermediate, self.groups * self.d_state, self.groups * self.d_state], dim=-1
        )
        grouped = (self.groups, self.d_state)
        return xs.unflatten(-1, (self.heads, self.head_dim)), B.unflatten(-1, grouped), C.unflatten(-1, grouped)

    def _causal_conv(self, inputs: torch.Tensor) -> torch.Tensor:
        """silu(depthwise causal conv): inputs [P, d_conv - 1 + n, C] -> [P * n, C], output j from inputs j..j+K-1.

        d_conv shifted multiply-adds in the [P, n, C] layout: no transposes to and from conv1d's channel-first
        layout, which cost more than the convolution itself at these sizes. The bias is the first addend."""
        n = inputs.shape[1] - (self.d_conv - 1)
        weight, bias = self.conv_weight, self.conv1d.bias
        out = inputs[:, :n] * weight[0] if bias is None else torch.addcmul(bias, inputs[:, :n], weight[0])
        for k in range(1, self.d_conv):
            out.addcmul_(inputs[:, k : k + n], weight[k])
        return F.silu(out, inplace=True).view(-1, self.conv_dim)

    def _prefill(
        self, lay: MambaPrefillLayout, xbc: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, D: torch.Tensor,
        y: torch.Tensor, conv_cache: torch.Tensor, ssm_cache: torch.Tensor,
    ) -> None:
        """All prefill sequences at once, in the layouts of mamba_layout.py."""
        prev = conv_cache.index_select(0, lay.slots).to(xbc.dtype)  # [P, width, conv_dim]
        if lay.aligned:  # the new rows are [P, n_max] as they are: copy them once behind the previous inputs
            width = self.d_conv - 1
            inputs = xbc.new_empty(lay.num_seqs, width + lay.max_rows, self.conv_dim)
            inputs[:, width:] = xbc.view(lay.num_seqs, lay.max_rows, self.conv_dim)
            torch.where(lay.resumed[:, None, None], prev, torch.zeros((), dtype=prev.dtype), out=inputs[:, :width])
        else:
            source = torch.cat([xbc, prev.reshape(-1, self.conv_dim), xbc.new_zeros(1, self.conv_dim)])
            inputs = source[lay.conv_index]  # [P, width + n_max, conv_dim]; inputs[i, j] = token c_i - width + j
        conv_rows = self._causal_conv(inputs)  # [P * n_max, conv_dim]
        if lay.aligned:
            xs, B, C = self._split_xbc(conv_rows.view(lay.num_seqs, -1, self.conv_dim))
            dt_scan = dt.view(lay.num_seqs, -1, self.heads)
        else:
            conv_rows = torch.cat([conv_rows, conv_rows.new_zeros(1, self.conv_dim)])
            xs, B, C = self._split_xbc(conv_rows[lay.scan_index])  # [P, L, ...]
            dt_scan = torch.cat([dt, dt.new_zeros(1, self.heads)])[lay.dt_index]
        initial = ssm_cache.index_select(0, lay.slots).float()
        initial = torch.where(lay.resumed[:, None, None, None], initial, torch.zeros((), dtype=initial.dtype))
        scan_out = y.view(lay.num_seqs, -1, self.heads, self.head_dim) if lay.aligned else None
        scan_y, boundary = chunked_scan(xs, dt_scan, A, B, C, D, initial, self.chunk_size, scan_out)
        if not lay.aligned:
            y[lay.out_rows] = scan_y.view(-1, self.intermediate).index_select(0, lay.out_index)
        states = boundary.view(-1, *self.ssm_state_shape).index_select(0, lay.state_index)
        ssm_cache.index_copy_(0, lay.save_slots, states.to(ssm_cache.dtype))
        conv_states = inputs.reshape(-1, self.conv_dim)[lay.conv_save_index]  # [V, width, conv_dim]
        conv_cache.index_copy_(0, lay.save_slots, conv_states.to(conv_cache.dtype))

    def _decode(
        self, d: MambaDecode, xbc: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, D: torch.Tensor,
        conv_cache: torch.Tensor, ssm_cache: torch.Tensor,
    ) -> torch.Tensor:
        """One recurrent step for the decode rows (xbc [S, conv_dim], dt [S, H]) -> y [S, intermediate] float32.
        When the slots form a progression (`d.slot_slice`), the states are updated in place in the cache (a
        strided view); otherwise they are read and written with whole-row gathers (`index_select` /
        `index_copy_` over dim 0) and updated in place in the gathered copy."""
        in_place = d.slot_slice is not None and ssm_cache.dtype == torch.float32
        if in_place:
            conv_prev, state = conv_cache[d.slot_slice], ssm_cache[d.slot_slice]
        else:
            conv_prev, state = conv_cache.index_select(0, d.slots), ssm_cache.index_select(0, d.slots).float()
        window = torch.cat([conv_prev.to(xbc.dtype), xbc[:, None, :]], dim=1)  # [S, d_conv, C]
        conv_out = (window * self.conv_weight).sum(1)
        if self.conv1d.bias is not None:
            conv_out.add_(self.conv1d.bias)
        xs, B, C = self._split_xbc(F.silu(conv_out, inplace=True))
        out = recurrent_step_(state, xs, dt, A, B, C, D)
        if in_place:
            conv_prev.copy_(window[:, 1:])
        else:
            conv_cache.index_copy_(0, d.slots, window[:, 1:].to(conv_cache.dtype))
            ssm_cache.index_copy_(0, d.slots, state.to(ssm_cache.dtype))
        for index, slot in d.saves:
            conv_cache[slot] = conv_cache[d.slots[index]]
            ssm_cache[slot] = ssm_cache[d.slots[index]]
        return out.view(-1, self.intermediate)


def _part_scale(shape: Mamba2Shape, dtype: torch.dtype) -> torch.Tensor | None:
    """[I + conv_dim + H]: each in_proj output's multiplier (gate z, x, B, C, dt), or None when all are 1."""
    if all(m == 1.0 for m in shape.in_proj_multipliers):
        return None
    state = shape.n_groups * shape.d_state
    sizes = (shape.intermediate_size, shape.intermediate_size, state, state, shape.n_heads)
    return torch.cat([torch.full((n,), m, dtype=torch.float32) for n, m in zip(sizes, shape.in_proj_multipliers)]).to(dtype)
