"""Running an evaluation: the model, plain vs SparseSpec decoding over the same batches, data parallel.

Every process (one per GPU under `accelerate launch`, or just one) takes its share of the examples
with accelerate's `split_between_processes`, decodes each left-padded batch with every mode in turn
(so both see the same batches and the same machine load), scores the outputs, and `gather_object`
brings all records to every process; the caller writes the report on the main process. Without
accelerate installed it runs as one process.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

import hf_sparsespec  # noqa: F401  (adds generation_strategy= to generate)
from hf_sparsespec.eval.config import WARMUP_TOKENS, EvalConfig
from hf_sparsespec.eval.data import Example, build_prompt, detect_task, load_records, select, to_examples
from hf_sparsespec.eval.report import build_report
from hf_sparsespec.eval.scoring import score
from hf_sparsespec.stats import EngineStats

logger = logging.getLogger(__name__)


# --- the model -------------------------------------------------------------------------------------
def load_model(name: str, dtype: str = "auto", device: str | torch.device = "cpu"):
    """(model, tokenizer) from a hub name, a local folder, a `.gguf` file, or `"smollm2"`; the
    tokenizer pads on the left and has a pad token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(device)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    if torch_dtype is None:  # auto
        torch_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if name == "smollm2":
        from hf_sparsespec.demo_model import smollm2_path

        name = str(smollm2_path())
    path = Path(name)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"expected a GGUF file at {path}")
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch_dtype)
    else:
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch_dtype)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:  # e.g. transformers 5.17 reads none from some GGUFs
        pad = model.generation_config.pad_token_id
        if pad is None:
            eos = model.generation_config.eos_token_id
            pad = eos[0] if isinstance(eos, list) else eos
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(pad if pad is not None else 0)
    return model.to(device).eval(), tokenizer


class Processes:
    """accelerate's `PartialState` (split and gather), or one process when accelerate is missing.

    On a machine without CUDA (or with `cpu=True`) the processes of a launch talk over gloo: accelerate
    forms a CPU process group only when asked for CPU.
    """

    def __init__(self, cpu: bool = False) -> None:
        try:
            from accelerate import PartialState
            from accelerate.utils import parse_flag_from_env
        except ImportError:
            self.state = None
            self.num_processes, self.process_index, self.is_main = 1, 0, True
            self.device = torch.device("cpu" if cpu or not torch.cuda.is_available() else "cuda")
            return
        cpu = cpu or parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available()
        self.state = PartialState(cpu=cpu)
        self.num_processes, self.process_index = self.state.num_processes, self.state.process_index
        self.is_main, self.device = self.state.is_main_process, self.state.device

    def share(self, items: list) -> list:
        if self.state is None or self.num_processes == 1:
            return list(items)
        with self.state.split_between_processes(list(items)) as mine:
            return list(mine)

    def gather(self, items: list) -> list:
        if self.state is None or self.num_processes == 1:
            return list(items)
        from accelerate.utils import gather_object

        return list(gather_object(list(items)))


# --- decoding --------------------------------------------------------------------------------------
def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set() if eos is None else {int(t) for t in (eos if isinstance(eos, (list, tuple)) else [eos])}


def decode(model, tokenizer, prompts: list[tuple[str, bool]], mode: str, config: EvalConfig, device, max_new_tokens=None):
    """Decode one batch with `mode`: (per-row dicts with token ids, text and stats, wall time in s,
    the engine's `EngineStats` or None for plain decoding)."""
    templated = prompts[0][1]
    encoded = tokenizer([p for p, _ in prompts], return_tensors="pt", padding=True, add_special_tokens=not templated)
    encoded = encoded.to(device)
    kwargs = dict(max_new_tokens=max_new_tokens or config.max_new_tokens, do_sample=config.do_sample,
                  return_dict_in_generate=True)
    if config.do_sample:
        kwargs.update(temperature=config.temperature, top_p=config.top_p)
    else:
        kwargs.update(temperature=None, top_p=None, top_k=None)
    if mode == "sparsespec":
        kwargs.update(generation_strategy="sparsespec", sparsespec_config=config.sparsespec_config())
    _synchronize(device)
    start = time.perf_counter()
    out = model.generate(**encoded, **kwargs)
    _synchronize(device)
    elapsed = time.perf_counter() - start
    width, eos_ids = encoded["input_ids"].shape[1], _eos_ids(model)
    rows = []
    for row, generated in enumerate(out.sequences[:, width:].tolist()):
        ends = [i for i, token in enumerate(generated) if token in eos_ids]
        ids = generated[: ends[0] + 1] if ends else generated
        stats = getattr(out, "sparsespec_stats", None)
        rows.append({
            "ids": ids,
            "text": tokenizer.decode(ids, skip_special_tokens=True),
            "finish": "eos" if ends else "length",
            "prompt_tokens": int(encoded["attention_mask"][row].sum()),
            "stats": stats.per_request[row].as_dict() if stats is not None else None,
        })
    engine = stats.engine if stats is not None else None
    return rows, elapsed, engine


def _run_examples(model, tokenizer, examples: list[Example], task: str, config: EvalConfig, device, show: bool):
    from tqdm.auto import tqdm

    prompts = [build_prompt(tokenizer, example, task, config) for example in examples]
    batches = [list(range(i, min(i + config.batch_size, len(examples)))) for i in range(0, len(examples), config.batch_size)]
    records, times = [], {mode: 0.0 for mode in config.modes}
    if config.warmup and examples:
        warmup_prompts = [prompts[i] for i in batches[0]]
        times["warmup"] = {}
        for mode in config.modes:
            _synchronize(device)
            start = time.perf_counter()
            decode(model, tokenizer, warmup_prompts, mode, config, device,
                   max_new_tokens=min(WARMUP_TOKENS, config.max_new_tokens))  # fmt: skip
            times["warmup"][mode] = time.perf_counter() - start
    engines = {mode: EngineStats() for mode in config.modes}
    progress = tqdm(total=len(batches) * len(config.modes), desc="eval", unit="batch", disable=not show)
    for batch in batches:
        outputs = {}
        for mode in config.modes:
            if config.do_sample:
                torch.manual_seed(config.seed + examples[batch[0]].index)
            progress.set_postfix_str(mode)
            rows, elapsed, engine = decode(model, tokenizer, [prompts[i] for i in batch], mode, config, device)
            outputs[mode] = rows, elapsed
            times[mode] += elapsed
            if engine is not None:
                engines[mode].merge(engine)
            progress.update(1)
        for position, i in enumerate(batch):
            example = examples[i]
            runs = {}
            for mode, (rows, elapsed) in outputs.items():
                row = rows[position]
                answer, correct = score(example, row["text"], task, config.humaneval_timeout)
                runs[mode] = {
                    "output": row["text"], "output_tokens": len(row["ids"]), "finish": row["finish"],
                    "answer": answer, "correct": correct, "time_s": elapsed, "batch_size": len(batch),
                    "tokens_per_second": len(row["ids"]) / elapsed if elapsed > 0 else None, "stats": row["stats"],
                }
            identical = None
            if len(outputs) == 2 and not config.do_sample:
                identical = outputs["plain"][0][position]["ids"] == outputs["sparsespec"][0][position]["ids"]
            records.append({
                "index": example.index, "id": example.id, "question": example.question,
                "reference": example.reference, "prompt_tokens": outputs[config.modes[0]][0][position]["prompt_tokens"],
                "identical": identical, "runs": runs,
            })
    progress.close()
    times["engine"] = {mode: engine.as_dict() for mode, engine in engines.items() if engine.iterations}
    return records, times


def run_eval(config: EvalConfig, model=None, tokenizer=None) -> dict:
    """Evaluate `config` (on this process's share of the examples when data parallel); returns the
    gathered report (the same on every process). A `model` and `tokenizer` already loaded (e.g. in a
    notebook) replace loading `config.model`; the tokenizer must pad on the left."""
    processes = Processes(cpu=config.device == "cpu")
    device = torch.device(config.device) if config.device else processes.device
    records = select(load_records(config.dataset, config.split), config)
    if not records:
        raise ValueError(f"expected records to evaluate in {config.dataset!r} after filters/offset/limit, got none")
    task = detect_task(records, config)
    examples = to_examples(records, task, config)
    if model is None or tokenizer is None:
        model, tokenizer = load_model(config.model, config.dtype, device)
    elif tokenizer.padding_side != "left":
        raise ValueError(f"expected a tokenizer with padding_side='left', got {tokenizer.padding_side!r}")
    device = next(model.parameters()).device
    logger.info("evaluating %d examples (%s task) on %d process(es)", len(examples), task, processes.num_processes)
    mine = processes.share(examples)
    results, times = _run_examples(model, tokenizer, mine, task, config, device, show=processes.is_main)
    all_records = processes.gather(results)
    all_times = processes.gather([{"process": processes.process_index, **times}])
    meta = {
        "task": task,
        "num_processes": processes.num_processes,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
    }
    return build_report(config, all_records, all_times, meta)
