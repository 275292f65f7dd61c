"""Built-in preference pairs: ``builtin:arithmetic_preference`` (for ``rlhforge rm`` / ``rlhforge dpo``).

Prompts are the ``builtin:arithmetic`` questions (same train/test split: no test problem is ever
a train problem). The chosen answer is direct and correct (``"19"``, ``"The answer is 19."``,
``"12 + 7 = 19."``); the rejected one is, by default, a hedged wrong answer (``"I am not sure,
maybe 23."``), a difference a tiny model learns in a few dozen steps, so reward-model accuracy
and DPO margins visibly rise. With ``hard=P`` (0..100), P% of the rejected answers are a bare
wrong number in the same style as the chosen one instead, which only a model that can add tells
apart.

Record fields (all forms of preference data at once, pick one by key mapping)::

    {"prompt": "What is 12 + 7?", "chosen": "19", "rejected": "I am not sure, maybe 23.",
     "margin": 1.0,                       # 1.0 for hedged rejections, 0.5 for bare wrong numbers
     "answer": "19", "datasource": "arithmetic_preference",
     "chosen_messages": [{"role": "user", ...}, {"role": "assistant", "content": "19"}],
     "rejected_messages": [{"role": "user", ...}, {"role": "assistant", ...}]}

- plain text: ``--data.prompt_key prompt --data.input_template 'Q: {}\\nA: '``;
- conversational: ``--data.prompt_key prompt --data.apply_chat_template``;
- implicit prompt: ``--data.chosen_key chosen_messages --data.rejected_key rejected_messages
  --data.apply_chat_template``.

Parameters (``builtin:arithmetic_preference?n=2000&seed=3&max=20&hard=0@test``): ``n``, ``seed``,
``max`` (operand range, as ``builtin:arithmetic``), ``hard`` (percentage, default 0).

``builtin:arithmetic_kto`` (for ``rlhforge kto``): the same problems unpaired, one completion each, the
chosen answer labelled desirable or the rejected one labelled undesirable (``desirable=P`` percent of them
desirable, default 50), ``{"prompt", "completion", "label", "answer", "datasource", "messages"}``.
"""

from __future__ import annotations

import random

from rlhforge.data.builtin import TEST_SPLITS, generate_builtin, register_builtin
from rlhforge.data.errors import DataError

__all__ = ["generate_arithmetic_preference", "generate_arithmetic_kto"]

NAME = "arithmetic_preference"

_DIRECT = ("{a}", "The answer is {a}.", "{expr} = {a}.")
_HEDGED = (
    "I am not sure, maybe {w}.",
    "I don't know. Perhaps {w}?",
    "Hard to say, it could be {w}.",
    "Maybe {w}, but I am not sure.",
    "I think it is {w}, but please check.",
)


def generate_arithmetic_preference(split: str = "train", n: int = 1000, seed: int = 0, max: int = 20, hard: int = 0) -> list[dict]:  # noqa: A002
    """Preference records over the ``builtin:arithmetic`` problems of ``split``; deterministic."""
    if not 0 <= hard <= 100:
        raise DataError(f"builtin:{NAME}: hard must be a percentage in 0..100 (got {hard})")
    base = generate_builtin("arithmetic", split=split, n=n, seed=seed, max=max)
    rng = random.Random(seed * 1_000_003 + (7 if split in TEST_SPLITS else 0) + 17)
    records = []
    for rec in base:
        prompt, answer = rec["prompt"], rec["answer"]
        expr = prompt[len("What is "):-1]
        wrong = int(answer) + rng.choice([d for d in range(-5, 6) if d != 0])
        style = rng.randrange(len(_DIRECT))
        chosen = _DIRECT[style].format(a=answer, expr=expr)
        if rng.random() * 100 < hard:
            rejected, margin = _DIRECT[style].format(a=wrong, expr=expr), 0.5
        else:
            rejected, margin = rng.choice(_HEDGED).format(w=wrong), 1.0
        user = {"role": "user", "content": prompt}
        records.append(
            {
                "prompt": prompt,
                "chosen": chosen,
                "rejected": rejected,
                "margin": margin,
                "answer": answer,
                "datasource": NAME,
                "chosen_messages": [user, {"role": "assistant", "content": chosen}],
                "rejected_messages": [user, {"role": "assistant", "content": rejected}],
            }
        )
    return records


register_builtin(NAME, generate_arithmetic_preference, {"max": 20, "hard": 0})


def generate_arithmetic_kto(split: str = "train", n: int = 1000, seed: int = 0, max: int = 20, hard: int = 0,  # noqa: A002
                            desirable: int = 50) -> list[dict]:
    """Unpaired (KTO) records over :func:`generate_arithmetic_preference`'s pairs; deterministic."""
    if not 0 <= desirable <= 100:
        raise DataError(f"builtin:arithmetic_kto: desirable must be a percentage in 0..100 (got {desirable})")
    rng = random.Random(seed * 7_919 + (3 if split in TEST_SPLITS else 0) + 29)
    records = []
    for pair in generate_arithmetic_preference(split, n=n, seed=seed, max=max, hard=hard):
        good = rng.random() * 100 < desirable
        completion = pair["chosen"] if good else pair["rejected"]
        records.append({"prompt": pair["prompt"], "completion": completion, "label": good, "answer": pair["answer"],
                        "datasource": "arithmetic_kto",
                        "messages": [{"role": "user", "content": pair["prompt"]},
                                     {"role": "assistant", "content": completion}]})
    return records


register_builtin("arithmetic_kto", generate_arithmetic_kto, {"max": 20, "hard": 0, "desirable": 50})
