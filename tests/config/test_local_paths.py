"""Local paths vs hub ids (issue 47, items 4 and 5; docs/config.md, "Model and data paths").

A path that looks local and does not exist ends the command at once with exit 2 naming the flag and
the path (no hub look-up, which retries for ~25-60 s without network); a hub id fails in seconds
when the hub cannot be reached; the RL driver sends Ray workers absolute paths; a resumed run whose
paths became absolute still matches its checkpoint's config.
"""

from __future__ import annotations

import dataclasses

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhforge.config.parsing import ConfigError
from rlhforge.config.paths import absolute_local_paths, is_hub_id, looks_local, model_paths
from rlhforge.models.loading import check_model_path

ROOT = Path(__file__).parents[2]
RL_REST = ["--data.prompt_dataset", "builtin:arithmetic", "--reward.remote_url", "builtin:arithmetic",
           "--rollout.batch_size", "8", "--train.batch_size", "8"]


@pytest.fixture
def cwd_with_runs(tmp_path, monkeypatch):
    """A working folder holding ``runs/`` (as after the README's first command) and nothing else."""
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _cli(args: list[str], cwd: Path, **env) -> subprocess.CompletedProcess:
    """``rlhforge ARGS`` in ``cwd``; the timeout only stops a hung command (the old hub retries took 50-64 s)."""
    return subprocess.run([sys.executable, "-m", "rlhforge.cli.main", *args], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT), **env}, timeout=30)


# --------------------------------------------------------------------------------------------- the rule


def test_what_looks_local(cwd_with_runs):
    for path in ("./m", "../m", "/m", "~/m", ".m", "a/b/c", "runs/rm", "runs\\rm"):
        assert looks_local(path), path
    for path in ("gpt2", "Qwen/Qwen3-0.6B", "org/runs", "runs"):
        assert not looks_local(path), path
    assert is_hub_id("Qwen/Qwen3-0.6B") and not is_hub_id("runs/rm") and not is_hub_id("runs")  # runs exists


def test_missing_folder_under_an_existing_parent_is_refused_naming_flag_and_path(cwd_with_runs):
    with pytest.raises(FileNotFoundError) as err:
        check_model_path("runs/rm", "--reward.model_name_or_path")
    assert str(err.value).startswith("--reward.model_name_or_path: model folder not found: runs/rm")
    assert "runs/ exists here" in str(err.value)
    check_model_path("org/name")  # a hub id: left to the hub look-up
    (cwd_with_runs / "runs" / "rm").mkdir()
    check_model_path("runs/rm")


# --------------------------------------------------------------------------------------------- hub ids


def test_unreachable_hub_fails_fast_naming_flag_and_id(monkeypatch):
    from huggingface_hub import constants

    from rlhforge.models import hub

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "in_hub_cache", lambda repo_id: False)
    with pytest.raises(ConfigError) as err:
        hub.check_model_sources([("--actor.model_name_or_path", "org/never-cached")],
                                probe=lambda: "ConnectError: name or service not known")
    msg = str(err.value)
    assert msg.startswith("--actor.model_name_or_path org/never-cached: not a local folder")
    assert "could not be reached" in msg and "ConnectError" in msg


def test_cached_hub_ids_load_offline_when_the_hub_is_unreachable(monkeypatch):
    from huggingface_hub import constants

    from rlhforge.models import hub

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # restored after the test
    monkeypatch.setattr(hub, "in_hub_cache", lambda repo_id: True)
    lines = []
    hub.check_model_sources([("--model.model_name_or_path", "org/cached")], probe=lambda: "ConnectError: x",
                            log=lines.append)
    assert constants.HF_HUB_OFFLINE and os.environ["HF_HUB_OFFLINE"] == "1"
    assert len(lines) == 1 and "org/cached" in lines[0] and "could not be reached" in lines[0]


def test_no_hub_call_for_local_paths(tiny_model_dir):
    def probe():
        raise AssertionError("the hub was probed for a local folder")

    from rlhforge.models.hub import check_model_sources

    check_model_sources([("--model.model_name_or_path", str(tiny_model_dir))], probe=probe)


def test_missing_hub_model_through_merge_lora_fails_in_seconds(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    proc = _cli(["merge-lora", "--model_path", "BASE", "--lora_path", str(adapter), "--output_path",
                 str(tmp_path / "out")], tmp_path,
                HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="0")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "--model_path BASE: not a local folder" in proc.stderr and "could not be reached" in proc.stderr


def _fake_hub_datasets(monkeypatch, cached: bool):
    """The hub unreachable; ``datasets.load_dataset`` answers from the 'cache' only in offline mode."""
    import datasets
    from huggingface_hub import constants

    from rlhforge.data import hub

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # tests/conftest.py sets HF_HUB_OFFLINE=1: undo it here
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "hub_unreachable", lambda timeout=3.0: "ConnectError: name or service not known")

    def load_dataset(name, split=None, **kwargs):
        if not datasets.config.HF_HUB_OFFLINE:
            raise AssertionError("asked the unreachable hub (the real client retries for ~25 s)")
        if not cached:
            raise FileNotFoundError(f"Dataset {name} is not cached")
        return datasets.Dataset.from_list([{"input": "1+1"}])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)


def test_hub_dataset_fails_fast_when_the_hub_is_unreachable(monkeypatch):
    from rlhforge.data.errors import DataError
    from rlhforge.data.loading import load_dataset_spec

    _fake_hub_datasets(monkeypatch, cached=False)
    with pytest.raises(DataError) as err:
        load_dataset_spec("org/prompts", None, "train", 10)
    assert "'org/prompts'" in str(err.value) and "could not be reached" in str(err.value)


def test_cached_hub_dataset_loads_offline_when_the_hub_is_unreachable(monkeypatch):
    import datasets

    from rlhforge.data.loading import load_dataset_spec

    _fake_hub_datasets(monkeypatch, cached=True)
    before = datasets.config.HF_HUB_OFFLINE
    records = load_dataset_spec("org/prompts", None, "train", 10)
    assert [r["input"] for r in records] == ["1+1"] and datasets.config.HF_HUB_OFFLINE == before


# --------------------------------------------------------------------------------------------- commands


def test_serve_rm_missing_local_folder_exits_2_at_once(cwd_with_runs):
    proc = _cli(["serve-rm", "--reward.model_name_or_path", "runs/does-not-exist"], cwd_with_runs)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "--reward.model_name_or_path: model folder not found: runs/does-not-exist" in proc.stderr


def test_merge_lora_missing_base_under_existing_parent_exits_2(cwd_with_runs):
    adapter = cwd_with_runs / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    proc = _cli(["merge-lora", "--model_path", "runs/base", "--lora_path", "adapter", "--output_path", "out"],
                cwd_with_runs)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "--model_path runs/base: folder not found" in proc.stderr


@pytest.mark.parametrize("command,flag", [("rl", "--actor.model_name_or_path"), ("sft", "--model.model_name_or_path"),
                                          ("rl", "--critic.model_name_or_path")])
def test_training_run_missing_model_under_existing_parent_exits_2_naming_the_flag(command, flag, cwd_with_runs,
                                                                                  tiny_model_dir, capsys):
    from rlhforge.cli.train_ppo_ray import main as rl_main
    from rlhforge.cli.train_sft import main as sft_main

    if command == "rl":
        main = rl_main
        argv = ["--actor.model_name_or_path", str(tiny_model_dir), *RL_REST, flag, "runs/sft_tiny"]
        if flag == "--critic.model_name_or_path":
            argv += ["--algo.advantage.estimator", "gae"]
    else:
        main, argv = sft_main, [flag, "runs/sft_tiny", "--data.dataset", "builtin:arithmetic"]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err
    assert f"{flag}: model folder not found: runs/sft_tiny" in err


# --------------------------------------------------------------------------------------------- absolute paths


def test_rl_driver_makes_local_paths_absolute_and_leaves_hub_ids(cwd_with_runs):
    from rlhforge.cli.train_ppo_ray import parse_rl_args

    t = cwd_with_runs
    for name in ("sft", "rm1", "critic"):
        (t / "runs" / name).mkdir()
    (t / "data").mkdir()
    for name in ("p.jsonl", "e.jsonl"):
        (t / "data" / name).write_text('{"input": "1+1"}\n')
    (t / "tmpl.jinja").write_text("{{ messages }}")
    (t / "reward.py").write_text("def reward_func(*a, **k):\n    return 0\n")
    cfg = parse_rl_args(["--actor.model_name_or_path", "runs/sft", "--critic.model_name_or_path", "runs/critic",
                         "--reward.model_name_or_path", "runs/rm1,org/rm2", "--reward.remote_url", "reward.py",
                         "--data.prompt_dataset", "data/p.jsonl@train,builtin:arithmetic,org/prompts",
                         "--eval.dataset", "data/e.jsonl", "--data.tokenizer_chat_template", "tmpl.jinja"],
                        validate=False)
    assert cfg.actor.model_name_or_path == str(t / "runs" / "sft")
    assert cfg.critic.model_name_or_path == str(t / "runs" / "critic")
    assert cfg.reward.model_name_or_path == f"{t / 'runs' / 'rm1'},org/rm2"
    assert cfg.reward.remote_url == str(t / "reward.py")
    assert cfg.data.prompt_dataset == f"{t / 'data' / 'p.jsonl'}@train,builtin:arithmetic,org/prompts"
    assert cfg.eval.dataset == str(t / "data" / "e.jsonl")
    assert cfg.data.tokenizer_chat_template == str(t / "tmpl.jinja")
    # the folders the Ray workers write (checkpoints, the final model): absolute even before they exist
    assert cfg.ckpt.output_dir == str(t / "ckpt") and cfg.ckpt.checkpoint_dir == str(t / "ckpt" / "checkpoints_ppo_ray")
    assert sorted(model_paths(cfg)) == sorted([("--actor.model_name_or_path", str(t / "runs" / "sft")),
                                               ("--critic.model_name_or_path", str(t / "runs" / "critic")),
                                               ("--reward.model_name_or_path", str(t / "runs" / "rm1")),
                                               ("--reward.model_name_or_path", "org/rm2")])


def test_hub_ids_and_other_values_are_left_alone(cwd_with_runs):
    from rlhforge.config.rl import RLConfig
    from rlhforge.config.sft import SFTConfig

    cfg = absolute_local_paths(RLConfig())
    assert cfg.ckpt.output_dir == str(cwd_with_runs / "ckpt")  # output folders: always absolute
    assert dataclasses.replace(cfg, ckpt=RLConfig().ckpt) == RLConfig()  # nothing else changed
    from rlhforge.config.parsing import from_dict

    sft = from_dict(SFTConfig, {"model": {"model_name_or_path": "Qwen/Qwen3-0.6B"},
                                "data": {"dataset": "org/data@test", "tokenizer_chat_template": "{{ x }}"}})
    done = absolute_local_paths(sft)
    assert dataclasses.replace(done, ckpt=sft.ckpt) == sft


def test_resume_counts_a_relative_and_an_absolute_path_of_one_folder_as_equal(cwd_with_runs):
    from rlhforge.trainers.resume import config_changes

    t = cwd_with_runs
    (t / "runs" / "sft").mkdir()
    (t / "p.jsonl").write_text("{}\n")
    saved = {"actor": {"model_name_or_path": "runs/sft"}, "data": {"prompt_dataset": "p.jsonl@train"},
             "reward": {"model_name_or_path": "runs/sft,org/rm"}}
    current = {"actor": {"model_name_or_path": str(t / "runs" / "sft")},
               "data": {"prompt_dataset": f"{t / 'p.jsonl'}@train"},
               "reward": {"model_name_or_path": f"{t / 'runs' / 'sft'},org/rm"}}
    assert config_changes(saved, current) == []
    current["reward"]["model_name_or_path"] = f"{t / 'runs' / 'sft'},org/other"
    assert [c[0] for c in config_changes(saved, current)] == ["reward.model_name_or_path"]
