"""--ds.use_liger_kernel and --ds.deepcompile are GPU features: on a CPU machine they are refused at
start-up with the hardware reason (exit 2); the DeepSpeed config carries DeepCompile's switch."""

import pytest
import torch

from rlhforge.cli.train_ppo_ray import main as rl_main
from rlhforge.cli.train_sft import main as sft_main
from rlhforge.config import validation
from rlhforge.config.components import DSConfig, OptimConfig
from rlhforge.config.parsing import ConfigError

RL = ["--actor.model_name_or_path", "/nonexistent/model", "--data.prompt_dataset", "builtin:arithmetic",
      "--reward.remote_url", "builtin:arithmetic", "--rollout.batch_size", "8", "--train.batch_size", "8"]
SFT = ["--model.model_name_or_path", "/nonexistent/model", "--data.dataset", "builtin:arithmetic"]
REASON = {"--ds.use_liger_kernel": "Liger's fused kernels are Triton GPU kernels",
          "--ds.deepcompile": "DeepCompile's op (deepspeed.ops.dc) is built for CUDA/ROCm only"}


@pytest.mark.parametrize("main, base", [(rl_main, RL), (sft_main, SFT)], ids=["rl", "sft"])
@pytest.mark.parametrize("flag", list(REASON))
@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_cpu_refuses_gpu_kernels_with_the_hardware_reason(main, base, flag, device, capsys):
    if torch.cuda.is_available() and device == "auto":
        pytest.skip("needs CUDA")  # 'auto' is a GPU here
    with pytest.raises(SystemExit) as err:
        main([*base, flag, "--train.device", device])
    assert err.value.code == 2
    line = [x for x in capsys.readouterr().err.splitlines() if ": error:" in x]
    assert len(line) == 1, line
    where = "the device is cpu" if device == "cpu" else "no CUDA device is visible"
    assert f"{flag} needs a CUDA GPU ({REASON[flag]}" in line[0] and where in line[0], line[0]
    assert "not supported" not in line[0] and "yet" not in line[0]


def test_gpu_without_the_liger_package_names_it(monkeypatch):
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is not None:
        pytest.skip("liger-kernel is installed: the message is for machines without it")
    monkeypatch.setattr(validation, "_cuda_available", lambda: True)  # the GPU branch of the check itself
    with pytest.raises(ConfigError, match="pip install liger-kernel"):
        validation.check_gpu_kernels(DSConfig(use_liger_kernel=True), "cuda")
    validation.check_gpu_kernels(DSConfig(deepcompile=True), "cuda")  # DeepCompile ships with DeepSpeed


def test_deepcompile_switch_in_the_deepspeed_config():
    from rlhforge.backend.deepspeed_strategy import deepspeed_config

    on = deepspeed_config(DSConfig(deepcompile=True, zero_stage=3), OptimConfig(), torch.bfloat16, 2, 4)
    off = deepspeed_config(DSConfig(zero_stage=3), OptimConfig(), torch.bfloat16, 2, 4)
    assert on["compile"] == {"deepcompile": True}
    assert "compile" not in off
    assert {k: v for k, v in on.items() if k != "compile"} == off
