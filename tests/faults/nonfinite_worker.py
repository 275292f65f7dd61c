"""Run in its own process (strategies build a one-rank process group): for each strategy spec
(``torch``, ``fsdp2``, ``deepspeed:STAGE``) a run of optimizer steps - good, NaN loss from a term
without a gradient path, NaN input (NaN loss and gradients), NaN gradient from a parameter hook
(not for FSDP2, whose sharded parameters see no autograd hooks), good - and a reference run of the
two good steps only, from the same initial weights. Prints one JSON object: per spec, each step's
``skipped``/``lr`` and whether the weights equal the reference's after its steps.

Usage: python -m tests.faults.nonfinite_worker SPEC [SPEC ...]
"""

from __future__ import annotations

import json
import sys

import torch


def _strategy(spec: str):
    from rlhforge.backend.factory import build_strategy
    from rlhforge.config.batching import plan_batches
    from rlhforge.config.components import AdamConfig, DSConfig, OptimConfig, TrainConfig

    name, _, stage = spec.partition(":")
    ds = DSConfig(strategy=name, zero_stage=int(stage or 0), param_dtype="fp32")
    optim = OptimConfig(adam=AdamConfig(lr=1e-2), lr_warmup_ratio=0.0)  # cosine: the lr moves every step
    plan = plan_batches(num_samples=4, batch_size=4, micro_batch_size=4, world_size=1, max_epochs=1)
    return build_strategy(ds, optim, TrainConfig(device="cpu", micro_batch_size=4, batch_size=4), plan)


def _weights(strategy) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in strategy.full_state_dict().items()}


def run(spec: str, kinds: list[str]) -> list[dict]:
    strategy = _strategy(spec)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    wrapped = strategy.prepare(model, 10)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    first = next(p for p in strategy.module.parameters())
    out = []
    for kind in kinds:
        before = _weights(strategy)
        hook = first.register_hook(lambda g: g * float("nan")) if kind == "nan_grad" else None
        inputs = x.clone()
        if kind == "nan_input":
            inputs[0, 0] = float("nan")
        loss = wrapped(inputs).pow(2).mean()
        if kind == "nan_loss":
            loss = loss + torch.tensor(float("nan"))  # no gradient path: the gradients alone stay finite
        strategy.backward(loss, is_last_micro_batch=True)
        stats = strategy.step()
        if hook is not None:
            hook.remove()
        after = _weights(strategy)
        out.append({"kind": kind, "skipped": stats["skipped"], "lr": stats["lr"],
                    "unchanged": all(torch.equal(before[k], after[k]) for k in before), "weights": after})
    return out


def main() -> None:
    result = {}
    for spec in sys.argv[1:]:
        kinds = ["good", "nan_loss", "nan_input"] + ([] if spec == "fsdp2" else ["nan_grad"]) + ["good"]
        steps = run(spec, kinds)
        ref = run(spec, ["good", "good"])
        same = all(torch.equal(steps[-1]["weights"][k], ref[-1]["weights"][k]) for k in ref[-1]["weights"])
        for s in steps + ref:
            del s["weights"]
        result[spec] = {"steps": steps, "reference": ref, "final_equals_reference": same}
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
