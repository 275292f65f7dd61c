"""Math answer checking: extraction, equivalent forms, wrong answers, garbage, the time guard."""

from __future__ import annotations

import importlib.util
import threading

import pytest

pytest.importorskip("math_verify")

import rlhforge.rewards.math as math_module  # noqa: E402
from rlhforge.rewards.math import MathVerifier, extract_answer, math_reward, reward_func  # noqa: E402


@pytest.fixture(scope="module")
def verifier():
    with MathVerifier(timeout_s=2.0, hard_grace_s=0.5) as v:
        yield v


@pytest.mark.parametrize("completion, expected", [
    (r"so the result is \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
    (r"first \boxed{2}, corrected: \boxed{ 4 }", "4"),
    (r"\boxed{\{1, 2\}} and more {braces}", r"\{1, 2\}"),
    (r"answer: \fbox{7}", "7"),
    (r"\boxed 5 apples", "5"),
    ("We have 3 apples and 1,250 pears, total 1,253.", "1,253"),
    ("it is -2.5 or maybe 3/4", "3/4"),
    (r"it equals \frac{3}{8}", r"\frac{3}{8}"),
    ("no numbers here", None),
    (r"broken \boxed{1 + (2", "2"),  # unbalanced box: fall back to the last number
])
def test_extract_answer(completion, expected):
    assert extract_answer(completion) == expected


@pytest.mark.parametrize("completion, label, reward", [
    (r"The answer is \boxed{\frac{1}{2}}.", "0.5", 1.0),           # fraction vs decimal
    ("So we get 0.5", r"\frac{1}{2}", 1.0),
    ("x = 1/2", "1/2", 1.0),
    (r"\boxed{\dfrac{-3}{4}}", "-0.75", 1.0),
    (r"\boxed{(x+1)^2}", "x^2+2x+1", 1.0),                        # symbolic equivalence
    (r"\boxed{2\sqrt{3}}", r"\sqrt{12}", 1.0),
    ("The total is 1,000 dollars.", "1000", 1.0),                  # thousands separator
    (r"\boxed{42}", r"$\boxed{42}$", 1.0),                         # label in LaTeX
    (r"\boxed{0.33}", r"\frac{1}{3}", 0.0),                        # close is not equal
    ("The answer is 7", "8", 0.0),                                 # wrong
    (r"first \boxed{4}, final \boxed{2}", "4", 0.0),               # only the last box counts
    ("I don't know", "5", 0.0),                                    # nothing to extract
    ("%$#@!\\boxed{", "5", 0.0),                                   # garbage
    (r"\boxed{\text{banana}}", "5", 0.0),
    (r"\boxed{5}", "", 0.0),                                       # unusable labels
    (r"\boxed{5}", None, 0.0),
])
def test_math_reward_cases(verifier, completion, label, reward):
    assert verifier(completion, label) == reward


def test_reasons_are_reported(verifier):
    assert verifier.check(r"\boxed{1/2}", "0.5").reason == "correct"
    assert verifier.check("nothing", "1").reason == "no_answer"
    assert verifier.check(r"\boxed{3}", "").reason == "bad_label"
    assert verifier.check(r"\boxed{3}", "4").reason == "wrong"


def test_hang_in_c_code_is_cut_off_and_the_helper_restarts(verifier):
    # comparing with a tower of powers makes sympy evaluate 9^(9^(9^9)) in C: no timer can stop it
    check = verifier.check(r"\boxed{9^{9^{9^{9}}}}", "1")
    assert check.reward == 0.0 and check.reason == "timeout"
    assert verifier(r"\boxed{2}", "2") == 1.0  # a fresh helper takes over
    assert verifier.restarts >= 1


def test_works_from_other_threads(verifier):
    results = []
    threads = [threading.Thread(target=lambda i=i: results.append(verifier(rf"\boxed{{{i}}}", str(i))))
               for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [1.0] * 4


def test_in_process_mode():
    v = MathVerifier(timeout_s=2.0, isolate=False)
    assert v(r"\boxed{\frac{2}{4}}", "0.5") == 1.0 and v("no", "1") == 0.0


def test_math_reward_and_reward_func_batch(verifier, monkeypatch):
    # the shared helper of math_reward / reward_func is swapped for the test's (saves a start-up)
    monkeypatch.setattr(math_module, "_shared_verifier", lambda timeout_s: verifier)
    assert math_reward(r"the answer is \boxed{10}", "10") == 1.0
    prompts = ["Q: 1+1?\nA:", "Q: half of 1?\nA:", "Q: 2*3?\nA:"]
    answers = [r" \boxed{2}", " it is 0.5", " I think 5"]
    out = reward_func([p + a for p, a in zip(prompts, answers)], prompts, ["2", r"\frac{1}{2}", "6"])
    assert out["rewards"].tolist() == [1.0, 1.0, 0.0]
    assert out["scores"].tolist() == [1.0, 1.0, 0.0]
    assert out["extra_logs"]["math/answer_found"].tolist() == [1.0, 1.0, 1.0]
    # rlhforge passes the responses themselves
    out = reward_func(["x"], ["y"], ["3"], responses=[r"\boxed{3}"])
    assert out["rewards"].tolist() == [1.0]


def test_missing_math_verify_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    with pytest.raises(ImportError, match=r"pip install 'rlhforge\[math\]'"):
        MathVerifier()
