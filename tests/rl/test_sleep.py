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
