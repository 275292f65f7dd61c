"""``--ds.enable_sleep``: optimizer states leave the device between training phases and come back
unchanged. On a CPU device there is nowhere to offload to (both calls are no-ops and say so); the
moving itself needs a GPU."""

import dataclasses

import pytest
import torch

from rlhforge.backend.sleep import move_optimizer_states, offload_states, reload_states


def _adam_with_state(device):
    model = torch.nn.Linear(64, 64).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 64, device=device)).square().mean().backward()
    opt.step()
    return model, opt


def test_cpu_device_has_nothing_to_offload():
    model, opt = _adam_with_state("cpu")

    @dataclasses.dataclass
    class S:
        device: torch.device
        optimizer: object

    s = S(torch.device("cpu"), opt)
    assert offload_states(s) == {"moved_bytes": 0} and reload_states(s) == {"moved_bytes": 0}
    assert move_optimizer_states(opt, "cpu") == 0  # already there


@pytest.mark.gpu
def test_optimizer_states_round_trip_through_host_memory():
    model, opt = _adam_with_state("cuda")
    before = {k: v.clone() for k, v in opt.state[model.weight].items() if torch.is_tensor(v)}
    allocated = torch.cuda.memory_allocated()
    moved = move_optimizer_states(opt, "cpu")
    moments = 2 * (64 * 64 + 64) * 4  # exp_avg + exp_avg_sq of weight and bias, fp32
    assert moments <= moved <= moments + 2 * 8  # (+ the two step counters where they live on the GPU)
    assert torch.cuda.memory_allocated() < allocated
    assert all(v.device.type == "cpu" for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
    move_optimizer_states(opt, "cuda")
    after = opt.state[model.weight]
    assert all(torch.equal(after[k].cpu(), before[k].cpu()) for k in before)
    opt.step()  # still a working optimizer


@pytest.mark.parametrize("stage", [3, 2])
def test_deepspeed_sleep_moves_the_optimizer_side_only(stage):
    """Issue 30, bug 2: ``offload_states()`` with no ``include`` also moved ``lp_params`` (ZeRO-3 crashed at
    the first sync). What DeepSpeed itself records as offloaded is the include list, never the parameters;
    the model still runs while asleep, and sleeping between steps changes no loss."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from rlhforge.backend.sleep import DEEPSPEED_OFFLOAD

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "tests.rl.ds_sleep_worker", str(stage)], cwd=root, env=dict(
        os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.split("RESULT ", 1)[1])
    slept, awake = res["slept"], res["awake"]
    assert sorted(DEEPSPEED_OFFLOAD) == ["contiguous_grad_buffer", "hp_params", "optim_states"]
    for moved in slept["offloaded"]:  # after start-up and after each of the 3 updates
        assert "lp_params" not in moved["deepspeed"] and "lp_grads" not in moved["deepspeed"]
        assert set(moved["deepspeed"]) <= set(DEEPSPEED_OFFLOAD)
        if stage == 3:  # ZeRO-3 offloads a FusedAdam's states only: a torch optimizer's are moved by rlhforge
            # ... and its fp32 master partitions too (gpu-review-2 F8: they used to stay on the device)
            assert moved["asked"] == ["contiguous_grad_buffer", "hp_params (fp32 master partitions)",
                                      "optim_states (torch optimizer)"]
            assert moved["deepspeed"] == ["contiguous_grad_buffer"]
        else:  # (ZeRO-2 records no contiguous buffer where it keeps none)
            assert moved["asked"] == list(DEEPSPEED_OFFLOAD) and moved["deepspeed"] == ["hp_params", "optim_states"]
        assert moved["optimizer_state_devices"] in ([], ["cpu"])  # (a CPU run: host memory either way)
    assert len(slept["offloaded"]) == 4
    assert slept["losses"] == pytest.approx(awake["losses"], abs=1e-6)  # states came back unchanged
    assert slept["losses"][-1] < slept["losses"][0]  # and training went on
    assert len(slept["weights_while_asleep"]) == 4  # 2 weights + 2 biases gathered while asleep


def test_deepspeed_sleep_refuses_zero_0():
    from rlhforge.backend.sleep import deepspeed_sleep

    with pytest.raises(ValueError, match="needs --ds.zero_stage 1-3"):
        deepspeed_sleep(object(), 0, to_host=True)
