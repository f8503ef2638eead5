"""Teacher-forced simulation of sparse self-speculative drafting over real text, many policies at once.

The prototype study's protocol (../shared/reference/acceptance-prototype-*.md), with the engine's
definitions of the recent window and the budget (`hf_sparsespec/scheduler.py`):

- The text x_0..x_{N-1} is prefilled once with full attention; its KV is the committed context of
  every cycle (teacher forcing: what was committed is always the text).
- A cycle starts at position t (x_t is the last committed token and has no KV yet). Draft step i
  feeds x_t (i = 0) or the row's own draft d_i at position t + i and attends, per (layer, KV head),
  the policy's old keys (j < recent_start) + the recent window (recent_start <= j < t) + the cycle's
  own draft keys. The draft is the argmax (greedy).
- The verification feeds [x_t, d_1..d_k] with full attention over the text keys j < t plus the block,
  causally. a = the longest prefix with d_{i+1} = argmax of the target at block position i (0..k).
  Its exact attention probabilities are what PillarAttn selects from (keys j < t).
- Next cycle: recent_start = t, t += a + 1, B = the engine's rule at that verification.
- The first cycle of an episode has recent_start = 0 (everything is recent: dense), as the engine's
  first round after prefill; it is a warm-up and is not counted.

Every (policy, episode) is one row of a batch: all rows share the text KV and run the model together
(row-specific positions, masks and draft KV), so a cycle costs k + 1 batched forward passes (plus k
for hindsight policies). The model runs unmodified through an attention function registered with
transformers' `AttentionInterface`; the per-call state reaches it through the forward kwarg
`acc_study`.

Bytes per draft step (per request, summed over layers and KV heads): K and V of every attended key
(selected old keys, recent window, own drafts) plus the extra key vectors a policy reads to choose
(page summaries, candidate keys), at `kv_bytes` per element (2: the engine's bf16 cache). Index reads
are not counted (4 bytes per selected key against 4 * head_dim for its K and V).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from study_policies import DraftView, Policy, VerifyView

ATTENTION_NAME = "acc_study"


def study_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    study = kwargs.get("acc_study")
    if study is None:
        raise RuntimeError("attn_implementation='acc_study' only runs inside benchmarks/study_harness.py")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return study.attend(module.layer_idx, query, key, value, scale), None


def register_study_attention() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, study_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, lambda *args, **kwargs: None)


@dataclass
class Group:
    policy: Policy
    local: slice  # rows of the current batch
    rows: slice  # rows of the study


class Study:
    """Runs every policy's episodes over one text at a time (`run_text`)."""

    def __init__(self, model, policies: list[Policy], num_draft: int = 8, kv_bytes: int = 2):
        self.model, self.policies, self.k, self.kv_bytes = model, policies, num_draft, kv_bytes
        self.device = next(model.parameters()).device
        self.num_layers = model.config.num_hidden_layers
        register_study_attention()
        model.set_attn_implementation(ATTENTION_NAME)
        self.mode = "idle"

    # --- the attention function ------------------------------------------------------------------
    def attend(self, layer: int, query, key, value, scale: float) -> torch.Tensor:
        if self.mode == "prefill":
            return self._prefill_attention(layer, query, key, value)
        if self.mode == "verify":
            return self._verify_attention(layer, query, key, value, scale)
        return self._draft_attention(layer, query, key, value, scale)

    def _prefill_attention(self, layer, query, key, value):
        self.text_k[layer], self.text_v[layer] = key[0].clone(), value[0].clone()  # [kvh, N, d]
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2)

    def _summaries(self, layer: int, page_size: int):
        """Per-page min and max of the text keys, `([kvh, pages, d], [kvh, pages, d])` (whole pages)."""
        if (layer, page_size) not in self.summaries:
            keys = self.text_k[layer]
            pages = keys.shape[1] // page_size
            paged = keys[:, : pages * page_size].reshape(keys.shape[0], pages, page_size, -1)
            self.summaries[layer, page_size] = (paged.amin(dim=2), paged.amax(dim=2))
        return self.summaries[layer, page_size]

    def _draft_attention(self, layer, query, key, value, scale):
        i, rows = self.step, self.batch_rows
        r, num_q_heads, _, d = query.shape
        kvh = key.shape[1]
        group = num_q_heads // kvh
        self.draft_k[layer][:, :, i], self.draft_v[layer][:, :, i] = key[:, :, 0], value[:, :, 0]
        q = query[:, :, 0].reshape(r, kvh, group, d)
        text_k, text_v = self.text_k[layer], self.text_v[layer]
        n = text_k.shape[1]
        j = torch.arange(n, device=self.device)[None, :]
        t, recent_start = self.t[rows], self.recent_start[rows]
        past = j < t[:, None]
        old = j < recent_start[:, None]
        recent = past & ~old
        logits = (torch.einsum("rhgd,hnd->rhgn", q, text_k) * scale).masked_fill(~past[:, None, None, :], float("-inf"))
        draft_k, draft_v = self.draft_k[layer][:, :, : i + 1], self.draft_v[layer][:, :, : i + 1]
        draft_logits = torch.einsum("rhgd,rhjd->rhgj", q, draft_k) * scale
        selected = torch.zeros(r, kvh, n, dtype=torch.bool, device=self.device)
        extra = torch.zeros(r, device=self.device)
        summaries = functools.partial(self._summaries, layer)
        for group_ in self.groups:
            loc = group_.local
            view = DraftView(step=i, position=t[loc] + i, query=q[loc], logits=logits[loc],
                             draft_logits=draft_logits[loc], old=old[loc], recent=recent[loc],
                             budget=self.budget[rows][loc], page_summaries=summaries,
                             input_token=self.input_token[loc], text=self.tokens)  # fmt: skip
            if self.mode == "probe":
                group_.policy.probe(layer, view)
                selected[loc] = old[loc][:, None, :]
            else:
                mask, more = group_.policy.draft_keys(layer, view)
                selected[loc], extra[loc] = mask & old[loc][:, None, :], more
        allowed = selected | recent[:, None, :]
        if self.mode == "draft":
            attended = allowed.sum(dim=(1, 2)).float() + kvh * (i + 1)  # keys over KV heads, drafts included
            self.units[rows] += 2.0 * attended + extra
            self.old_keys[rows] += selected.sum(dim=(1, 2)).float()
        logits = logits.masked_fill(~allowed[:, :, None, :], float("-inf"))
        weights = torch.softmax(torch.cat([logits, draft_logits], dim=-1), dim=-1)
        out = torch.einsum("rhgn,hnd->rhgd", weights[..., :n], text_v)
        out = out + torch.einsum("rhgj,rhjd->rhgd", weights[..., n:], draft_v)
        return out.reshape(r, 1, num_q_heads, d)

    def _verify_attention(self, layer, query, key, value, scale):
        r, num_q_heads, num_q, d = query.shape
        kvh = key.shape[1]
        group = num_q_heads // kvh
        q = query.reshape(r, kvh, group, num_q, d)
        text_k, text_v = self.text_k[layer], self.text_v[layer]
        n = text_k.shape[1]
        t = self.t
        past = torch.arange(n, device=self.device)[None, :] < t[:, None]
        logits = torch.einsum("rhgqd,hnd->rhgqn", q, text_k) * scale
        logits = logits.masked_fill(~past[:, None, None, None, :], float("-inf"))
        causal = torch.ones(num_q, num_q, dtype=torch.bool, device=self.device).tril()
        block = (torch.einsum("rhgqd,rhjd->rhgqj", q, key) * scale).masked_fill(~causal, float("-inf"))
        weights = torch.softmax(torch.cat([logits, block], dim=-1), dim=-1)
        probs = weights[..., :n]
        for group_ in self.groups:
            loc = group_.local
            view = VerifyView(probs=probs[loc], block_start=t[loc], budget=self.next_budget[loc])
            group_.policy.verified(layer, view)
        out = torch.einsum("rhgqn,hnd->rhgqd", probs, text_v)
        out = out + torch.einsum("rhgqj,rhjd->rhgqd", weights[..., n:], value)
        return out.reshape(r, num_q_heads, num_q, d).transpose(1, 2)

    # --- forward passes ------------------------------------------------------------------------------
    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, acc_study=self)
        return out.logits

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """Full-attention KV of the text; returns the logits of the last position (or of every
        position, `[N, vocab]`, for harness checks)."""
        self.text_k, self.text_v = [None] * self.num_layers, [None] * self.num_layers
        self.summaries = {}
        self.mode = "prefill"
        positions = torch.arange(tokens.shape[0], device=self.device)[None, :]
        out = self.model(input_ids=tokens[None, :], position_ids=positions, use_cache=False, acc_study=self,
                         logits_to_keep=0 if all_logits else 1)  # fmt: skip
        self.mode = "idle"
        return out.logits[0]

    def _draft_phase(self, groups: list[Group], probe: bool) -> torch.Tensor:
        """k draft steps for the rows of `groups`; returns their draft tokens [rows, k]."""
        self.groups = [Group(g.policy, g.local, g.rows) for g in groups]
        self.batch_rows = torch.cat([torch.arange(g.rows.start, g.rows.stop) for g in groups]).to(self.device)
        r = self.batch_rows.shape[0]
        cfg = self.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = (r, cfg.num_key_value_heads, self.k, head_dim)
        dtype = next(self.model.parameters()).dtype
        self.draft_k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(self.num_layers)]
        self.draft_v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(self.num_layers)]
        self.mode = "probe" if probe else "draft"
        token = self.tokens[self.t[self.batch_rows]]
        drafts = torch.empty(r, self.k, dtype=torch.long, device=self.device)
        for i in range(self.k):
            self.step, self.input_token = i, token
            logits = self._forward(token[:, None], (self.t[self.batch_rows] + i)[:, None])
            token = drafts[:, i] = logits[:, -1].argmax(-1)
        self.mode = "idle"
        return drafts

    def _verify(self, drafts: torch.Tensor) -> torch.Tensor:
        """The verification of every row; returns the target's argmax at the k+1 block positions."""
        self.mode = "verify"
        block = torch.cat([self.tokens[self.t][:, None], drafts], dim=1)
        positions = self.t[:, None] + torch.arange(self.k + 1, device=self.device)[None, :]
        targets = self._forward(block, positions).argmax(-1)
        for group_ in self.groups:
            group_.policy.verify_done()
        self.mode = "idle"
        return targets

    @torch.no_grad()
    def run_text(self, tokens: list[int], anchors: list[int], num_cycles: int) -> list[dict]:
        """Every policy from every anchor: 1 warm-up cycle + `num_cycles` counted cycles per episode.

        Returns one record per counted (policy, episode, cycle)."""
        k = self.k
        if max(anchors) + (num_cycles + 1) * (k + 1) >= len(tokens):
            raise ValueError(f"anchors: the last one ({max(anchors)}) leaves no room for {num_cycles + 1} cycles "
                             f"in {len(tokens)} tokens")  # fmt: skip
        self.tokens = torch.tensor(tokens, dtype=torch.long, device=self.device)
        self.prefill(self.tokens)
        num_episodes = len(anchors)
        groups = []
        for index, policy in enumerate(self.policies):
            rows = slice(index * num_episodes, (index + 1) * num_episodes)
            policy.bind(rows, self.num_layers)
            groups.append(Group(policy, rows, rows))
        num_rows = num_episodes * len(self.policies)
        self.t = torch.tensor(anchors, dtype=torch.long, device=self.device).repeat(len(self.policies))
        self.recent_start = torch.zeros(num_rows, dtype=torch.long, device=self.device)
        self.budget = torch.zeros(num_rows, dtype=torch.long, device=self.device)
        records = []
        for cycle in range(num_cycles + 1):
            hindsight = [g for g in groups if g.policy.hindsight]
            if hindsight:
                local, start = [], 0
                for g in hindsight:
                    size = g.rows.stop - g.rows.start
                    local.append(Group(g.policy, slice(start, start + size), g.rows))
                    start += size
                self._draft_phase(local, probe=True)
                for g in hindsight:
                    old = torch.arange(len(tokens), device=self.device)[None, :] < self.recent_start[g.rows, None]
                    g.policy.end_probe(self.budget[g.rows], old)
            self.units = torch.zeros(num_rows, device=self.device)
            self.old_keys = torch.zeros(num_rows, device=self.device)
            drafts = self._draft_phase(groups, probe=False)
            self.next_budget = torch.cat([g.policy.budget(self.t[g.rows], k) for g in groups])
            targets = self._verify(drafts)
            match = (drafts == targets[:, :k]).long()
            accepted = match.cumprod(dim=1).sum(dim=1)
            if cycle > 0:
                records.extend(self._records(groups, cycle, accepted))
            self.recent_start = self.t.clone()
            self.budget = self.next_budget
            self.t = self.t + accepted + 1
        return records

    def _records(self, groups: list[Group], cycle: int, accepted: torch.Tensor) -> list[dict]:
        cfg = self.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        per_step = (self.units / self.k * head_dim * self.kv_bytes).tolist()
        old_keys = (self.old_keys / (self.k * self.num_layers * cfg.num_key_value_heads)).tolist()
        t, recent, budget, acc = (x.tolist() for x in (self.t, self.recent_start, self.budget, accepted))
        out = []
        for g in groups:
            for episode, row in enumerate(range(g.rows.start, g.rows.stop)):
                out.append({"policy": g.policy.name, "min_budget": g.policy.study_min_budget, "episode": episode,
                            "cycle": cycle, "t": t[row], "recent_start": recent[row], "budget": budget[row],
                            "accepted": acc[row], "bytes_per_step": per_step[row],
                            "old_keys_per_head": old_keys[row]})  # fmt: skip
        return out
