"""Texts for the acceptance study: sampled continuations of real mmath prompts, cached to JSON.

Two recipes (the prototype studies' texts, ../shared/reference/acceptance-prototype-*.md):
- single turn: end-of-turn tokens suppressed until `min_new` tokens, optionally a windowed CTRL
  repetition penalty (SmolLM2's plain samples fall into verbatim loops, which inflate acceptance);
- multi-turn (`turns=True`): whenever the model ends its turn (or reaches `turn_cap` tokens, then the
  end-of-turn token is forced), the next mmath problem is appended as a user turn, teacher-forced,
  until the text holds `max_new` tokens after the prompt (sampled and forced); realistic long contexts
  for models that answer in < 1.5K tokens.

Each text records the spans the model did not sample (prompt, forced user turns): episodes are placed
only where every token the drafts are checked against was sampled.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from prompts import SUFFIX, load_mmath
from transformers import LogitsProcessor, LogitsProcessorList


class WindowedRepetitionPenalty(LogitsProcessor):
    """CTRL-style penalty `theta` on tokens among the last `window` input tokens."""

    def __init__(self, theta: float, window: int):
        self.theta, self.window = theta, window

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        recent = input_ids[:, -self.window :]
        picked = scores.gather(1, recent)
        picked = torch.where(picked > 0, picked / self.theta, picked * self.theta)
        return scores.scatter(1, recent, picked)


def problems(sources=("AIME2024", "AIME2025", "MATH500"), first: int = 0) -> list[dict]:
    """mmath problems from `sources`, interleaved (the order `prompts.reasoning_prompts` uses), starting
    at the `first`-th (the pool wraps around): another `first` gives texts on other problems, a held-out
    set for checking what was tuned on the default one."""
    by_source = {s: [p for p in load_mmath() if p["data_source"] == s] for s in sources}
    picked = []
    while any(by_source.values()):
        for source in sources:
            if by_source[source]:
                picked.append(by_source[source].pop(0))
    if not 0 <= first < len(picked):
        raise ValueError(f"first problem: expected 0 <= first < {len(picked)}, got {first}")
    return picked[first:] + picked[:first]


def _user_text(problem: dict) -> str:
    return f"{problem['question']}\n{SUFFIX}"


def _batched_generate(model, tokenizer, contexts: list[list[int]], max_new: int, min_new: int, sample: dict,
                      stop_ids: list[int], processors) -> list[list[int]]:  # fmt: skip
    """One left-padded `generate` call; each row's new tokens up to and including its first stop token."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    width = max(len(c) for c in contexts)
    ids = torch.tensor([[pad] * (width - len(c)) + c for c in contexts], device=model.device)
    mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts], device=model.device)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=min_new,
                         eos_token_id=stop_ids, pad_token_id=pad, logits_processor=processors, **sample)  # fmt: skip
    rows = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, tok in enumerate(row) if tok in stop_ids), len(row))
        rows.append(row[:cut])
    return rows


def generate_texts(model, tokenizer, count: int, max_new: int, min_new: int = 0, temperature: float = 0.6,
                   top_p: float = 1.0, seed: int = 1234, penalty: float = 0.0, window: int = 96,
                   turns: bool = False, turn_cap: int = 1400, first_problem: int = 0) -> list[dict]:  # fmt: skip
    """`count` texts: dicts with `tokens` (prompt + continuation), `prompt_len`, `forced` ([start, end)
    spans not sampled by the model, the prompt included) and the recipe. Texts start on the problems
    `first_problem, first_problem + 1, ...` of `problems()` (multi-turn texts take the next ones)."""
    pool = problems(first=first_problem)
    stop_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    stop_ids = [i for i in stop_ids if isinstance(i, int) and i >= 0] or list(
        filter(None, [model.generation_config.eos_token_id])
    )
    end_of_turn = stop_ids[0]
    suppress = tokenizer.convert_tokens_to_ids("<|im_start|>")
    sample = dict(do_sample=True, temperature=temperature, top_k=0, top_p=top_p,
                  suppress_tokens=[suppress] if isinstance(suppress, int) else None)  # fmt: skip
    processors = LogitsProcessorList([WindowedRepetitionPenalty(penalty, window)] if penalty > 0 else [])
    torch.manual_seed(seed)

    def template(problem, first: bool) -> list[int]:
        messages = [{"role": "user", "content": _user_text(problem)}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        if first:
            return list(ids)
        return tokenizer.encode(f"\n<|im_start|>user\n{_user_text(problem)}<|im_end|>\n<|im_start|>assistant\n",
                                add_special_tokens=False)  # fmt: skip

    texts = [{"tokens": template(pool[i], True), "forced": [], "turns": 1} for i in range(count)]
    for text in texts:
        text["prompt_len"] = len(text["tokens"])
        text["forced"].append([0, text["prompt_len"]])
    if not turns:
        news = _batched_generate(model, tokenizer, [t["tokens"] for t in texts], max_new, min_new, sample,
                                 stop_ids, processors)  # fmt: skip
        for text, new in zip(texts, news):
            text["tokens"] += new
    else:
        next_problem = count
        active = list(range(count))
        while active:
            budgets = [max_new - (len(texts[i]["tokens"]) - texts[i]["prompt_len"]) for i in active]
            cap = min(turn_cap, max(budgets))
            news = _batched_generate(model, tokenizer, [texts[i]["tokens"] for i in active], cap, 0, sample,
                                     stop_ids, processors)  # fmt: skip
            still = []
            for i, new, budget in zip(active, news, budgets):
                new = new[:budget]
                text = texts[i]
                text["tokens"] += new
                if len(new) == budget:
                    continue  # reached max_new
                if not new or new[-1] != end_of_turn:
                    text["forced"].append([len(text["tokens"]), len(text["tokens"]) + 1])
                    text["tokens"].append(end_of_turn)
                user = template(pool[next_problem % len(pool)], False)
                next_problem += 1
                if max_new - (len(text["tokens"]) - text["prompt_len"]) <= len(user):
                    continue  # no room for another turn
                text["forced"].append([len(text["tokens"]), len(text["tokens"]) + len(user)])
                text["tokens"] += user
                text["turns"] += 1
                still.append(i)
            active = still
    recipe = stored_recipe(dict(max_new=max_new, min_new=min_new, temperature=temperature, top_p=top_p, seed=seed,
                                penalty=penalty, window=window, turns=turns, turn_cap=turn_cap,
                                first_problem=first_problem))  # fmt: skip
    for text in texts:
        text["recipe"] = recipe
    return texts


def stored_recipe(recipe: dict) -> dict:
    """The recipe as a texts file records it: `first_problem` only where set, so that files made before
    the option existed keep matching theirs."""
    return {key: value for key, value in recipe.items() if not (key == "first_problem" and value == 0)}


def load_or_generate(path: Path, model, tokenizer, count: int, **recipe) -> list[dict]:
    """The first `count` texts cached at `path`, or new ones (then cached there). A cache made by another
    recipe, or holding fewer texts, is an error (regenerating silently could take many minutes)."""
    path = Path(path)
    if path.is_file():
        texts = json.loads(path.read_text())
        if len(texts) < count or any(t["recipe"] != stored_recipe(recipe) for t in texts):
            raise ValueError(f"{path} holds {len(texts)} texts made with {texts[0]['recipe']}; expected >= {count} "
                             f"made with {recipe}: pass the same recipe, or another --texts-file")  # fmt: skip
        return texts[:count]
    texts = generate_texts(model, tokenizer, count, **recipe)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(texts))
    return texts


def anchors(text: dict, episodes: int, span: int) -> list[int]:
    """`episodes` cycle starts, evenly spaced over positions p whose window [p, p + span) was sampled."""
    forced = torch.zeros(len(text["tokens"]) + span, dtype=torch.bool)
    for start, end in text["forced"]:
        forced[start:end] = True
    forced[len(text["tokens"]) :] = True
    # the cycle start token x_t is committed context; what is checked starts at t + 1
    bad = torch.tensor([bool(forced[p + 1 : p + span].any()) for p in range(len(text["tokens"]))])
    valid = (~bad).nonzero().flatten().tolist()
    valid = [p for p in valid if p >= text["prompt_len"] - 1]
    if len(valid) < episodes:
        return valid
    step = (len(valid) - 1) / max(episodes - 1, 1)
    return [valid[round(i * step)] for i in range(episodes)]
