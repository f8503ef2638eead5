"""paged_attention: causal attention of variable-length query blocks against each request's paged KV.

Serves prefill chunks and verification blocks (and dense decoding). Row `r` owns queries
`query_start[r]:query_start[r+1]`; they sit at the last `q_len` positions of its context, so query `i`
of the row (position `context_lens[r] - q_len + i`) attends keys `0 .. position` (bottom-right
aligned causal mask). GQA: query head `h` reads KV head `h // (num_q_heads // num_kv_heads)`.
Returns the output and the natural-log log-sum-exp of the scaled logits per (token, query head),
which PillarAttn scoring reuses.
"""

from __future__ import annotations

import torch

from hf_sparsespec.kernels._paging import gather_context


def paged_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    page_table: torch.Tensor,  # [num_rows, max_pages] int32
    query_start: torch.Tensor,  # [num_rows + 1] int32
    context_lens: torch.Tensor,  # [num_rows] int32, keys visible to the row's last query
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference (and CPU backend): returns `(out [num_tokens, num_q_heads, head_dim] in query.dtype,
    lse [num_tokens, num_q_heads] float32)`. Computed in float32."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros_like(query)
    lse = torch.full((num_tokens, num_q_heads), float("-inf"), dtype=torch.float32, device=query.device)
    starts = query_start.tolist()
    for row, ctx in enumerate(context_lens.tolist()):
        q0, q1 = starts[row], starts[row + 1]
        if q1 == q0:
            continue
        q_len = q1 - q0
        q = query[q0:q1].float().view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        k = gather_context(k_cache, page_table[row], ctx).float().transpose(0, 1)  # [kvh, ctx, d]
        v = gather_context(v_cache, page_table[row], ctx).float().transpose(0, 1)
        logits = torch.einsum("hgqd,hkd->hgqk", q, k) * scale  # [kvh, g, q_len, ctx]
        q_pos = torch.arange(ctx - q_len, ctx, device=query.device)
        allowed = torch.arange(ctx, device=query.device)[None, :] <= q_pos[:, None]  # [q_len, ctx]
        logits = logits.masked_fill(~allowed, float("-inf"))
        row_lse = torch.logsumexp(logits, dim=-1)  # [kvh, g, q_len]
        probs = torch.exp(logits - row_lse[..., None])
        row_out = torch.einsum("hgqk,hkd->qhgd", probs, v).reshape(q_len, num_q_heads, head_dim)
        out[q0:q1] = row_out.to(query.dtype)
        lse[q0:q1] = row_lse.permute(2, 0, 1).reshape(q_len, num_q_heads)
    return out, lse
