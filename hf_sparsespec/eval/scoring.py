"""Answer extraction and scoring: boxed math answers, GSM-style numbers, HumanEval pass@1.

HumanEval programs (the model's function, the task's tests, `check(entry_point)`) run in a fresh
Python subprocess with a timeout; a program passes when it exits with status 0. That runs code the
model wrote, unsandboxed: evaluate untrusted models inside a container.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from fractions import Fraction
from pathlib import Path

from hf_sparsespec.eval.data import Example

COMPLETION_STOPS = ("\nclass ", "\ndef ", "\n#", "\nif __name__", "\nprint(", "\nassert ")


# --- math ------------------------------------------------------------------------------------------
def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if there is none."""
    matches = list(re.finditer(r"\\(?:boxed|fbox)", text))
    if not matches:
        return None
    rest = text[matches[-1].end() :]
    if not rest.startswith("{"):
        match = re.match(r"\s+([^\s$]+)", rest)  # \boxed 5
        return match.group(1) if match else None
    depth = 0
    for index, char in enumerate(rest):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return rest[1:index]
    return None


def normalize_answer(answer: str) -> str:
    """A canonical spelling of a short math answer (LaTeX noise, units of degrees, spaces removed)."""
    text = answer.strip()
    text = re.sub(r"\\text\{(.*?)\}", r"\1", text)
    text = re.sub(r"\\mbox\{(.*?)\}", r"\1", text)
    for noise in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "$", "^\\circ", "^{\\circ}", "\\%", "%", "°"):
        text = text.replace(noise, "")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\displaystyle", "")
    text = re.sub(r"\s+", "", text).rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text):
        text = text.replace(",", "")
    text = re.sub(r"^[a-zA-Z]\s*=", "", text)  # x = 5
    return text.lower()


def to_number(answer: str) -> Fraction | None:
    """The value of a normalized answer that is a number or a simple fraction; None otherwise."""
    text = answer.replace("{", "(").replace("}", ")")
    match = re.fullmatch(r"(-?)\\frac\((-?\d+)\)\((-?\d+)\)", text) or re.fullmatch(r"(-?)\\frac(\d)(\d)", text)
    try:
        if match:
            value = Fraction(int(match.group(2)), int(match.group(3)))
            return -value if match.group(1) else value
        match = re.fullmatch(r"(-?\d+)/(\d+)", text)
        if match:
            return Fraction(int(match.group(1)), int(match.group(2)))
        if re.fullmatch(r"-?(\d+\.?\d*|\.\d+)(e-?\d+)?", text):
            return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def answers_match(predicted: str | None, reference: str) -> bool:
    if predicted is None:
        return False
    a, b = normalize_answer(predicted), normalize_answer(reference)
    if a == b:
        return True
    x, y = to_number(a), to_number(b)
    return x is not None and y is not None and abs(x - y) <= Fraction(1, 10**6) * max(1, abs(y))


def extract_math_answer(text: str) -> str | None:
    """The last `\\boxed{}`, else what follows the last "final answer is" (to the end of its line or
    sentence); None when neither is there."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    matches = re.findall(r"final answer is[:\s]*(.+?)(?:\.\s|\.$|\n|$)", text, flags=re.IGNORECASE)
    return matches[-1].strip().strip("$") if matches else None


def extract_gsm_answer(text: str) -> str | None:
    """Boxed if present, else `#### x`, else `the answer is x`, else the last number."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    for pattern in (r"####\s*([^\n]+)", r"answer is[:\s]*\$?([-\d.,/]+)"):
        matches = re.findall(pattern, text, flags=re.IGNORECASE)
        if matches:
            return matches[-1].strip()
    numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    return numbers[-1] if numbers else None


def gsm_reference(reference: str) -> str:
    """GSM8K references end in `#### answer`; others are the answer itself."""
    return reference.split("####")[-1].strip() if "####" in reference else reference


def math_reference(reference: str) -> str:
    """A reference solution with a boxed answer (MATH) gives that answer; others are the answer."""
    boxed = extract_boxed(reference)
    return boxed if boxed is not None else reference


# --- HumanEval -------------------------------------------------------------------------------------
def humaneval_program(example: Example, output: str) -> str:
    """The program to run: the model's function (from its code block, or the prompt continued by its
    completion), then the task's tests and `check(entry_point)`."""
    prompt, entry_point = example.extra["prompt"], example.extra["entry_point"]
    blocks = re.findall(r"```(?:python|py)?\s*\n(.*?)```", output, flags=re.DOTALL)
    unterminated = re.findall(r"```(?:python|py)?\s*\n(.*)$", output, flags=re.DOTALL)
    candidates = blocks or unterminated
    full = next((block for block in candidates if f"def {entry_point}" in block), None)
    if full is not None:
        imports = "\n".join(line for line in prompt.splitlines() if line.startswith(("import ", "from ")))
        code = f"{imports}\n{full}"
    else:
        completion = candidates[0] if candidates else output
        cut = min((completion.find(stop) for stop in COMPLETION_STOPS if stop in completion), default=len(completion))
        code = prompt + completion[:cut]
    return f"{code}\n\n{example.extra['test']}\n\ncheck({entry_point})\n"


def run_program(program: str, timeout: float) -> bool:
    """Whether `program` exits with status 0 within `timeout` seconds, in a fresh isolated interpreter."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "program.py"
        path.write_text(program)
        try:
            result = subprocess.run(
                [sys.executable, "-I", str(path)], cwd=folder, capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired:
            return False
    return result.returncode == 0


# --- one output ------------------------------------------------------------------------------------
def score(example: Example, output: str, task: str, timeout: float = 10.0) -> tuple[str | None, bool | None]:
    """(extracted answer, correct); correct is None when the task has no scoring."""
    if task == "math":
        answer = extract_math_answer(output)
        return answer, answers_match(answer, math_reference(example.reference or ""))
    if task == "gsm":
        answer = extract_gsm_answer(output)
        return answer, answers_match(answer, gsm_reference(example.reference or ""))
    if task == "humaneval":
        return None, run_program(humaneval_program(example, output), timeout)
    return None, None
