"""Stage ``hf_decode`` of the GPU check (run in a child process by check_rl_child.py): the HF engine's two
decode loops on the check's model, ``--rollout.hf_decode eager`` against ``graphs`` (static KV cache, bucketed
shapes, CUDA graphs: rlhforge.rollout.graph_decode), at the GRPO stages' rollout shape (prompts x samples rows,
``new_tokens`` each), in the run's precision: greedy agreement, then sampled tokens/s
(benchmarks/bench_hf_decode.py's :func:`compare`). check_rl.py's summary sets the graphs' tokens/s beside TRL's
generation in its ``trl`` stage and the ``grpo_torch`` stage's (whose engine decodes with ``auto``: graphs on CUDA).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_hf_decode(spec: dict, res) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_hf_decode import compare

    dtype = torch.bfloat16 if spec["param_dtype"] == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype).to(spec["device"]).eval()
    tok = AutoTokenizer.from_pretrained(spec["model"])
    res.update(compare(model, tok.pad_token_id, len(tok), spec["rows"], spec["new_tokens"], spec["rounds"]))
    res["headline"] = (f"{spec['rows']} rows x {spec['new_tokens']} tokens: eager {res['eager']['tokens_per_s_median']}"
                       f" tok/s, graphs {res['graphs']['tokens_per_s_median']} tok/s ({res['graphs_speedup_median']}x;"
                       f" captured: {res['graphs_captured']}), greedy rows equal {res['greedy_rows_equal']}/"
                       f"{res['greedy_rows']}")
    res["ok"] = res["graphs_captured"] == (spec["device"] == "cuda")
    if not res["ok"]:
        res.fail("--rollout.hf_decode graphs did not capture CUDA graphs on CUDA" if spec["device"] == "cuda"
                 else "graphs captured off CUDA")
