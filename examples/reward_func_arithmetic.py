"""A reward function file for ``--reward.remote_url examples/reward_func_arithmetic.py`` (OpenRLHF's contract).

``reward_func(queries, prompts, labels, **kwargs)`` gets the full texts (prompt + response), the
prompt texts and the labels (``--data.label_key``); rlhforge also passes ``responses`` (response
text only), ``datasources`` and ``finish_reasons`` when the function accepts them. It returns
``rewards`` (the RL signal), ``scores`` (0-1, for dynamic filtering and pass@k) and
``extra_logs`` (logged as ``rollout/<name>``). It may be ``async``.
"""

import re

_INT = re.compile(r"-?\d+")


def reward_func(queries, prompts, labels, **kwargs):
    responses = kwargs.get("responses") or [q[len(p):] for q, p in zip(queries, prompts)]
    scores = []
    for response, label in zip(responses, labels):
        match = _INT.search(response)
        scores.append(float(match is not None and int(match.group()) == int(label)))
    has_number = [float(_INT.search(r) is not None) for r in responses]
    return {"rewards": scores, "scores": scores, "extra_logs": {"has_number": has_number}}
