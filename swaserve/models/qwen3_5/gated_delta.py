"""The Gated DeltaNet recurrence (Qwen3.5's "linear_attention" layers), in float32, written
to the same arithmetic as transformers' torch fallbacks (`torch_chunk_gated_delta_rule`,
`torch_recurrent_gated_delta_rule`, the causal conv1d), so that a prompt computed in any
chunking, a decode and a drafted decode agree with them to float32 round-off.

Per value head h, with the state S [d_k, d_v], each token t (q, k l2-normed, q scaled by
d_k^-1/2, decay g <= 0, rate beta in (0, 1)):

    S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - k_t^T S))^T;  o_t = q_t^T S

`recurrent` runs it token by token (decodes, drafts: one state per token if asked);
`chunked` runs a prompt chunk through the UT transform in blocks of 64 tokens, as
transformers does, from any initial state. Key heads serve `value heads / key heads`
consecutive value heads each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 64  # tokens per block of the chunked scan (transformers' chunk_size)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The depthwise causal convolution over x [B, C, N] after the window `state`
    [B, C, K - 1] (the previous K - 1 inputs), SiLU after: (out [B, C, N] in x's dtype,
    the inputs [B, C, K - 1 + N] it read: the state after token j is
    `inputs[..., j + 1:j + K]`). The K taps are summed in float32 in one order, so a token
    gets the same bits in a decode, a draft or a chunk."""
    k = weight.shape[-1]
    inputs = torch.cat([state.to(x.dtype), x], dim=-1)
    n = x.shape[-1]
    w = weight.float()
    acc = inputs[..., 0:n].float() * w[:, 0:1]
    for j in range(1, k):
        acc = acc + inputs[..., j:j + n].float() * w[:, j:j + 1]
    return F.silu(acc).to(x.dtype), inputs


def heads_first(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[B, T, heads, d] (and [B, T, heads]) to float32 [B, value heads, T, ...], key heads
    repeated over their value heads, q and k l2-normed."""
    hv = v.shape[2]
    if q.shape[2] != hv:
        q = q.repeat_interleave(hv // q.shape[2], dim=2)
        k = k.repeat_interleave(hv // k.shape[2], dim=2)
    q, k, v, beta, g = (t.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                        for t in (q, k, v, beta, g))
    return l2norm(q), l2norm(k), v, g, beta


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, state: torch.Tensor, keep_states: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Token by token from `state` [B, H, d_k, d_v]: (out [B, H, T, d_v], the final state,
    and with `keep_states` the state after each token but the last)."""
    q = q / (q.shape[-1] ** 0.5)
    out = torch.zeros_like(v)
    kept: list[torch.Tensor] = []
    t_len = q.shape[2]
    for i in range(t_len):
        q_t, k_t, v_t = q[:, :, i], k[:, :, i], v[:, :, i]
        state = state * g[:, :, i].exp()[..., None, None]
        kv_mem = (state * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - kv_mem) * beta[:, :, i].unsqueeze(-1)
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, i] = (state * q_t.unsqueeze(-1)).sum(dim=-2)
        if keep_states and i < t_len - 1:
            kept.append(state)
    return out, state, kept


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor, state: torch.Tensor, block: int = BLOCK
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """All T tokens from `state` [B, H, d_k, d_v] in blocks of `block`: (out [B, H, T, d_v],
    the final state). transformers' torch_chunk_gated_delta_rule, step for step."""
    b, h, t_len, dk = k.shape
    dv = v.shape[-1]
    q = q * dk ** -0.5
    pad = (block - t_len % block) % block
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(b, h, -1, block, x.shape[-1])
                            for x in (q, k, k_beta, v_beta))
    g = g.reshape(b, h, -1, block)
    upper = torch.ones(block, block, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=3)
    pairwise = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, decayed_k_beta, upper=False,
                                               unitriangular=True)
    state = state.to(new_values)
    out = torch.zeros_like(new_values)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    block_decay = cum[..., -1].exp()[..., None, None]
    for i in range(new_values.shape[2]):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * block_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    return out.reshape(b, h, -1, dv)[:, :, :t_len], state
