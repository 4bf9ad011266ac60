"""The Mamba2 mixer over state slots of the KV cache.

A slot holds the conv state (the last d_conv - 1 pre-conv inputs xBC, [d_conv - 1, conv_dim], oldest first)
and the ssm state ([heads, head_dim, d_state], float32). A prefill chunk starts from the sequence's slot
(zeros when num_computed == 0: a slot may hold a previous owner's state), writes the states the scheduler
asked for (`mamba_saves`) and its final state back to the slot. Decode rows (one new token, num_computed > 0)
take one batched recurrent step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridpd.engine.kv_cache.storage import KVCacheStorage
from hybridpd.engine.model.config import HybridConfig
from hybridpd.engine.model.layers import GatedRMSNorm
from hybridpd.engine.model.ssd import chunked_scan, recurrent_step_
from hybridpd.engine.model.step_context import MambaDecode, MambaGroupMeta, MambaPrefill, StepContext


class Mamba2Mixer(nn.Module):
    def __init__(self, config: HybridConfig, layer_id: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.heads = config.mamba_n_heads
        self.head_dim = config.mamba_d_head
        self.groups = config.mamba_n_groups
        self.d_state = config.mamba_d_state
        self.d_conv = config.mamba_d_conv
        self.chunk_size = config.mamba_chunk_size
        self.intermediate = config.mamba_intermediate_size
        self.conv_dim = config.mamba_conv_dim
        self.dt_min, self.dt_max = config.time_step_limit
        self.in_proj = nn.Linear(
            config.hidden_size, self.intermediate + self.conv_dim + self.heads, bias=config.mamba_proj_bias,
            dtype=dtype,
        )
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, kernel_size=self.d_conv, groups=self.conv_dim,
            bias=config.mamba_conv_bias, padding=self.d_conv - 1, dtype=dtype,
        )
        self.dt_bias = nn.Parameter(torch.ones(self.heads, dtype=dtype))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, self.heads + 1, dtype=torch.float32)).to(dtype))
        self.D = nn.Parameter(torch.ones(self.heads, dtype=dtype))
        self.norm = GatedRMSNorm(
            self.intermediate, self.intermediate // self.groups, config.rms_norm_eps, dtype
        )
        self.out_proj = nn.Linear(self.intermediate, config.hidden_size, bias=config.mamba_proj_bias, dtype=dtype)

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
        gate, xbc, dt_raw = self.in_proj(x).split([self.intermediate, self.conv_dim, self.heads], dim=-1)
        dt = F.softplus(dt_raw.float() + self.dt_bias.float()).clamp(self.dt_min, self.dt_max)
        conv_cache, ssm_cache = kv.mamba_views(self.layer_id)
        y = torch.empty(x.shape[0], self.intermediate, dtype=torch.float32)
        if meta.decode is not None:
            self._decode(meta.decode, xbc, dt, y, conv_cache, ssm_cache)
        for p in meta.prefills:
            self._prefill(p, xbc, dt, y, conv_cache, ssm_cache)
        return self.out_proj(self.norm(y, gate).to(x.dtype))

    def _split_xbc(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[rows, conv_dim] -> x [rows, H, P], B and C [rows, H, N] (each group's B/C repeated over its heads)."""
        rows = conv_out.shape[0]
        xs, B, C = conv_out.float().split(
            [self.intermediate, self.groups * self.d_state, self.groups * self.d_state], dim=-1
        )
        per_group = self.heads // self.groups
        # Expanded views (stride 0 over a group's heads): no copy where the consumer reads them as they are.
        B = B.view(rows, self.groups, 1, self.d_state).expand(rows, self.groups, per_group, self.d_state)
        C = C.view(rows, self.groups, 1, self.d_state).expand(rows, self.groups, per_group, self.d_state)
        B = B.reshape(rows, self.heads, self.d_state)
        C = C.reshape(rows, self.heads, self.d_state)
        return xs.view(rows, self.heads, self.head_dim), B, C

    def _prefill(
        self, p: MambaPrefill, xbc: torch.Tensor, dt: torch.Tensor, y: torch.Tensor,
        conv_cache: torch.Tensor, ssm_cache: torch.Tensor,
    ) -> None:
        rows = slice(p.row_start, p.row_start + p.num_rows)
        if p.num_computed > 0:
            conv_prev = conv_cache[p.slot].to(xbc.dtype)
            initial = ssm_cache[p.slot].float()
        else:
            conv_prev = xbc.new_zeros(self.conv_state_shape)
            initial = torch.zeros(self.ssm_state_shape, dtype=torch.float32)
        # inputs[i] is the xBC of token num_computed - (d_conv - 1) + i
        inputs = torch.cat([conv_prev, xbc[rows]], dim=0)
        conv_out = F.conv1d(inputs.T[None], self.conv1d.weight, self.conv1d.bias, groups=self.conv_dim)[0].T
        xs, B, C = self._split_xbc(F.silu(conv_out))
        A = -torch.exp(self.A_log.float())
        scan = chunked_scan(xs, dt[rows], A, B, C, initial, p.num_computed, self.chunk_size)
        y[rows] = (scan.y + self.D.float()[None, :, None] * xs).reshape(p.num_rows, self.intermediate)

        end = p.num_computed + p.num_rows
        for num_tokens, slot in (*p.saves, (end, p.slot)):
            if num_tokens != end and num_tokens % self.chunk_size:
                raise ValueError(
                    f"mamba save at {num_tokens} tokens: not a multiple of mamba_chunk_size ({self.chunk_size}) "
                    f"nor the step's end ({end})"
                )
            chunk_index = (
                scan.boundary_states.shape[0] - 1 if num_tokens == end
                else (num_tokens - scan.first_boundary) // self.chunk_size
            )
            first_input = num_tokens - p.num_computed
            conv_cache[slot] = inputs[first_input : first_input + self.d_conv - 1].to(conv_cache.dtype)
            ssm_cache[slot] = scan.boundary_states[chunk_index].to(ssm_cache.dtype)

    def _decode(
        self, d: MambaDecode, xbc: torch.Tensor, dt: torch.Tensor, y: torch.Tensor,
        conv_cache: torch.Tensor, ssm_cache: torch.Tensor,
    ) -> None:
        """One recurrent step for every decode row. Slots are read and written with whole-row gathers
        (`index_select` / `index_copy_` over dim 0), and the state is updated in place in its gathered copy."""
        conv_prev = conv_cache.index_select(0, d.slots).to(xbc.dtype)  # [S, d_conv - 1, C]
        window = torch.cat([conv_prev, xbc[d.rows, None, :]], dim=1)  # [S, d_conv, C]
        conv_out = (window * self.conv1d.weight[:, 0, :].T).sum(1)
        if self.conv1d.bias is not None:
            conv_out = conv_out + self.conv1d.bias
        xs, B, C = self._split_xbc(F.silu(conv_out))
        A = -torch.exp(self.A_log.float())
        state = ssm_cache.index_select(0, d.slots).float()
        out = recurrent_step_(state, xs, dt[d.rows], A, B, C)
        y[d.rows] = (out + self.D.float()[None, :, None] * xs).reshape(len(d.rows), self.intermediate)
        conv_cache.index_copy_(0, d.slots, window[:, 1:].to(conv_cache.dtype))
        ssm_cache.index_copy_(0, d.slots, state.to(ssm_cache.dtype))
        for index, slot in d.saves:
            conv_cache[slot] = conv_cache[d.slots[index]]
            ssm_cache[slot] = ssm_cache[d.slots[index]]
