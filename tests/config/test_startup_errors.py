"""Mistakes that used to crash after start-up now end the command at start-up, through the real CLI
entry points: exit 2, one line naming the flag or YAML key (or path, or URL), no traceback, before
any model is loaded (the model paths here do not exist, so reaching the model load would say so)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhforge.cli.lora_combiner import main as merge_main
from rlhforge.cli.serve_rm import main as serve_main
from rlhforge.cli.train_dpo import main as dpo_main
from rlhforge.cli.train_ppo_ray import main as rl_main
from rlhforge.cli.train_rm import main as rm_main
from rlhforge.cli.train_sft import main as sft_main
from rlhforge.config.parsing import ConfigError, from_dict
from rlhforge.config.rl import RLConfig
from rlhforge.config.sft import SFTConfig

ROOT = Path(__file__).parents[2]
MISSING = "/nonexistent/model"  # a model load would fail with "model folder not found"
RL_BASE = ["--actor.model_name_or_path", MISSING, "--data.prompt_dataset", "builtin:arithmetic",
           "--reward.remote_url", "builtin:arithmetic", "--rollout.batch_size", "8", "--train.batch_size", "8"]
TRAIN_BASE = ["--model.model_name_or_path", MISSING, "--data.dataset", "builtin:arithmetic"]
COMMANDS = {
    "rl": (rl_main, RL_BASE),
    "sft": (sft_main, TRAIN_BASE),
    "rm": (rm_main, TRAIN_BASE),
    "dpo": (dpo_main, TRAIN_BASE),
    "serve-rm": (serve_main, ["--reward.model_name_or_path", MISSING]),
}


def refused(main, argv, capsys) -> str:
    """Run ``main(argv)``; assert exit 2 with one error line and no traceback; return that line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2, exc.value.code
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if "error" in x]
    assert len(lines) == 1, err
    assert "Traceback" not in err and "model folder not found" not in err, err
    return lines[0]


# --------------------------------------------------------------------------------------------- YAML values


YAML_CASES = {
    # command: [(yaml text, dotted key named, words the message must hold)]
    "rl": [
        ("algo:\n  advantage:\n    estimator: grpo\n", "algo.advantage.estimator", ["'grpo'", "group_norm, dr_grpo"]),
        ("actor:\n  eps_clip_low_high: 0.2\n", "actor.eps_clip_low_high", ["2 values", "0.2"]),
        ("actor.policy_loss_type: sppo\n", "actor.policy_loss_type", ["ppo, gspo"]),
        ("rollout:\n  n_samples_per_prompt: 2.5\n", "rollout.n_samples_per_prompt", ["integer", "2.5"]),
        ("train:\n  seed: null\n", "train.seed", ["null"]),
        ("reward:\n  clip_range: [1, 2, 3]\n", "reward.clip_range", ["2 values"]),
        ("logger:\n  progress_bar: off\n", "logger.progress_bar", ["auto, on, off", "quote"]),
    ],
    "sft": [
        ("ds:\n  param_dtype: bf32\n", "ds.param_dtype", ["auto, bf16, fp16, fp32"]),
        ("optim.adam.betas: [0.9]\n", "optim.adam.betas", ["2 values"]),
        ("ds:\n  packing_samples: maybe\n", "ds.packing_samples", ["true or false"]),
    ],
    "rm": [("optim:\n  lr_scheduler: cosine_restarts\n", "optim.lr_scheduler", ["cosine_with_min_lr"])],
    "dpo": [("train:\n  batch_size: eight\n", "train.batch_size", ["integer", "'eight'"])],
    "serve-rm": [("device: tpu\n", "device", ["auto, cpu, cuda"])],
}


@pytest.mark.parametrize("command, case", [(c, i) for c, cases in YAML_CASES.items() for i in range(len(cases))])
def test_yaml_values_are_checked_against_the_field_types(command, case, tmp_path, capsys):
    text, key, words = YAML_CASES[command][case]
    path = tmp_path / "run.yaml"
    path.write_text(text)
    main, base = COMMANDS[command]
    line = refused(main, [*base, "--config", str(path)], capsys)
    assert str(path) in line and f"{key}:" in line, line
    for word in words:
        assert word in line, (word, line)


def test_yaml_values_that_fit_are_converted():
    cfg = from_dict(RLConfig, {"actor": {"adam": {"lr": "1e-6"}, "eps_clip_low_high": [0.2, 0.28]},  # 1e-6: a YAML str
                               "rollout.max_new_tokens": 1e3, "reward": {"clip_range": None},
                               "algo": {"advantage": {"is_correction_threshold": 3}}, "ds.lora.target_modules": "q_proj"})
    assert cfg.actor.adam.lr == 1e-6 and cfg.actor.eps_clip_low_high == (0.2, 0.28)
    assert cfg.rollout.max_new_tokens == 1000 and isinstance(cfg.rollout.max_new_tokens, int)
    assert cfg.algo.advantage.is_correction_threshold == (3.0,) and cfg.ds.lora.target_modules == ("q_proj",)
    with pytest.raises(ConfigError, match=r"x.yaml: train.batch_size: expected an integer, got True"):
        from_dict(SFTConfig, {"train": {"batch_size": True}}, where="x.yaml")
    with pytest.raises(ConfigError, match=r"x.yaml: unknown key 'lrr' in optim.adam \(AdamConfig\)"):
        from_dict(SFTConfig, {"optim": {"adam": {"lrr": 1}}}, where="x.yaml")


# --------------------------------------------------------------------------------------------- flags


@pytest.mark.parametrize("command", ["rl", "sft", "rm", "dpo"])
def test_logging_steps_must_be_positive(command, capsys):
    main, base = COMMANDS[command]
    line = refused(main, [*base, "--logger.logging_steps", "0"], capsys)
    assert "--logger.logging_steps must be >= 1 (got 0)" in line


@pytest.mark.parametrize("command", ["rl", "sft", "rm", "dpo"])
@pytest.mark.parametrize("flag, value, message", [
    ("--train.preempt_grace_s", "-1", "--train.preempt_grace_s must be >= 0 seconds (got -1.0"),
    ("--train.max_skipped_steps_in_row", "-2", "--train.max_skipped_steps_in_row must be >= 0 (got -2"),
])
def test_fault_limits_must_not_be_negative(command, flag, value, message, capsys):
    main, base = COMMANDS[command]
    assert message in refused(main, [*base, flag, value], capsys)


def test_agent_max_stuck_threads_must_be_positive(capsys):
    main, base = COMMANDS["rl"]
    assert "--train.agent_max_stuck_threads must be >= 1 (got 0)" in refused(
        main, [*base, "--train.agent_max_stuck_threads", "0"], capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="4-bit loading is possible with CUDA")
@pytest.mark.parametrize("command", ["rl", "sft", "rm", "dpo", "serve-rm"])
def test_load_in_4bit_without_cuda_is_refused_at_start_up(command, capsys):
    main, base = COMMANDS[command]
    lora = [] if command == "serve-rm" else ["--ds.lora.rank", "4"]
    line = refused(main, [*base, *lora, "--ds.load_in_4bit"], capsys)
    assert "--ds.load_in_4bit" in line and "CUDA" in line


# --------------------------------------------------------------------------------------------- reward servers


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tiny_app():
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/get_reward")
    async def get_reward(payload: dict):
        return {"rewards": [0.0] * len(payload["query"])}

    return app


def test_unreachable_reward_url_fails_at_start_up(capsys):
    url = f"http://127.0.0.1:{_free_port()}/get_reward"
    line = refused(rl_main, [*RL_BASE, "--reward.remote_url", url], capsys)
    assert url in line and "does not answer" in line and "--reward.wait_for_server_s" in line


def test_wrong_path_and_bad_url_fail_at_start_up(capsys):
    from rlhforge.rewards.server import start_server_thread

    with start_server_thread(_tiny_app()) as handle:
        line = refused(rl_main, [*RL_BASE, "--reward.remote_url", handle.base_url + "/reward"], capsys)
        assert "HTTP 404" in line and "/get_reward" in line
    line = refused(rl_main, [*RL_BASE, "--reward.remote_url", "http://host:port/get_reward"], capsys)
    assert "--reward.remote_url" in line and "invalid port" in line


def test_waiting_for_a_server_that_never_comes(capsys):
    url = f"http://127.0.0.1:{_free_port()}/get_reward"
    line = refused(rl_main, [*RL_BASE, "--reward.remote_url", url, "--reward.wait_for_server_s", "1.5"], capsys)
    assert url in line and "after waiting 1.5 s" in line


def test_waiting_for_a_server_that_starts_late(capsys):
    import threading

    from rlhforge.rewards.server import start_server_thread

    port = _free_port()
    handles = []
    # late enough that the probe has failed at least once even on a loaded machine
    timer = threading.Timer(5.0, lambda: handles.append(start_server_thread(_tiny_app(), port=port)))
    timer.start()
    try:
        with pytest.raises(SystemExit) as exc:
            rl_main([*RL_BASE, "--reward.remote_url", f"http://127.0.0.1:{port}/get_reward",
                     "--reward.wait_for_server_s", "30"])
    finally:
        timer.join()
        for h in handles:
            h.stop()
    out = capsys.readouterr()
    assert "[rlhforge] waiting for reward server" in out.out
    assert exc.value.code == 2 and "model folder not found: /nonexistent/model" in out.err  # probe passed


def test_negative_wait_is_refused(capsys):
    line = refused(rl_main, [*RL_BASE, "--reward.wait_for_server_s", "-1"], capsys)
    assert "--reward.wait_for_server_s must be >= 0" in line


# --------------------------------------------------------------------------------------------- merge-lora


def test_merge_lora_bad_paths(tiny_model_dir, tmp_path, capsys):
    out = str(tmp_path / "merged")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    cases = [
        (["--model_path", str(tmp_path / "nope"), "--lora_path", str(adapter)], f"--model_path {tmp_path / 'nope'}"),
        (["--model_path", str(tiny_model_dir), "--lora_path", str(tmp_path / "gone")], f"--lora_path {tmp_path / 'gone'}"),
        (["--model_path", str(tiny_model_dir), "--lora_path", str(tiny_model_dir)], "no adapter_config.json"),
        (["--model_path", str(adapter), "--lora_path", str(adapter)], "not an HF model folder"),
        (["--model_path", str(tiny_model_dir), "--lora_path", str(adapter)], f"--lora_path {adapter}"),  # broken adapter
    ]
    for argv, words in cases:
        line = refused(merge_main, [*argv, "--output_path", out], capsys)
        assert words in line, (words, line)
    (tmp_path / "file").write_text("x")
    line = refused(merge_main, ["--model_path", str(tiny_model_dir), "--lora_path", str(adapter), "--output_path",
                                str(tmp_path / "file")], capsys)
    assert "--output_path" in line and "not a folder" in line


def test_merge_lora_bad_path_through_the_console_entry_point(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rlhforge.cli.main", "merge-lora", "--model_path", str(tmp_path / "no"),
                           "--lora_path", str(tmp_path / "no2"), "--output_path", str(tmp_path / "out")],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"rlhforge merge-lora: error: --model_path {tmp_path / 'no'}: folder not found"


# --------------------------------------------------------------------------------------------- IS correction


def _runs_in_corrections(level, mode, gating, low, high) -> bool:
    from rlhforge.algorithms.corrections import is_correction

    lp = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -0.2, -0.9]])
    roll = lp + torch.tensor([[0.1, -0.2, 0.0], [0.4, 0.0, -0.1]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    try:
        is_correction(lp, roll, mask, level=level, mode=mode, gating=gating, low=low, high=high)
    except ValueError:
        return False
    return True


THRESHOLDS = [(0.5, 5.0), (5.0,), (0.0, 0.003), (0.003,), (2.0, 1.0), (0.0, 5.0), (-1.0,), (0.0, -1.0), (0.5,)]


def test_is_correction_start_up_rules_match_the_maths():
    """Every level x mode x gating x threshold accepted at start-up runs through
    ``corrections.is_correction``, and every refused one raises there too."""
    from rlhforge.config.rl_rules import check_is_correction, is_correction_band
    from rlhforge.config.rl import AdvantageConfig

    accepted = refused_n = 0
    for level, mode, gating, th in itertools.product(("token", "seq"), ("mask", "clip"), ("ratio", "binary_kl", "tv"),
                                                     THRESHOLDS):
        adv = AdvantageConfig(is_correction_level=level, is_correction_mode=mode, is_correction_gating=gating,
                              is_correction_threshold=th)
        try:
            check_is_correction(adv)
            ok = True
        except ConfigError as err:
            ok = False
            assert "--algo.advantage.is_correction_" in str(err)
        assert ok == _runs_in_corrections(level, mode, gating, *is_correction_band(th)), (level, mode, gating, th)
        accepted, refused_n = accepted + ok, refused_n + (not ok)
    assert accepted > 10 and refused_n > 10
    check_is_correction(AdvantageConfig(is_correction_level="off", is_correction_gating="tv"))  # off: unchecked
    with pytest.raises(ConfigError, match="takes one value .HIGH. or two .LOW HIGH., got 3"):
        check_is_correction(AdvantageConfig(is_correction_level="token", is_correction_threshold=(0.5, 1.0, 2.0)))


@pytest.mark.parametrize("extra, words", [
    (["--algo.advantage.is_correction_level", "seq", "--algo.advantage.is_correction_gating", "binary_kl"],
     "is_correction_gating binary_kl takes an upper bound only"),
    (["--algo.advantage.is_correction_level", "seq", "--algo.advantage.is_correction_mode", "clip"],
     "is_correction_mode clip works per token only"),
    (["--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_mode", "clip",
      "--algo.advantage.is_correction_gating", "tv", "--algo.advantage.is_correction_threshold", "0.01"],
     "needs --algo.advantage.is_correction_gating ratio"),
    (["--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_threshold", "2"],
     "gating ratio needs a band LOW HIGH"),
])
def test_is_correction_refusals_through_the_cli(extra, words, capsys):
    assert words in refused(rl_main, [*RL_BASE, *extra], capsys)
