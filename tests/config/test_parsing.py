import pytest

from rlhforge.config.batching import plan_batches
from rlhforge.config.parsing import ConfigError, parse_args, rewrite_aliases, save_yaml
from rlhforge.config.sft import SFTConfig

BASE = ["--model.model_name_or_path", "m", "--data.dataset", "d.jsonl"]


def test_dotted_flags_and_openrlhf_flat_names():
    cfg = parse_args(SFTConfig, BASE + ["--train.micro_batch_size", "2", "--adam.lr", "1e-4", "--max_norm", "0.5",
                                        "--lr_scheduler", "constant", "--adam.betas", "0.8", "0.9",
                                        "--ds.packing_samples", "--ds.lora.target_modules", "q_proj", "v_proj"])
    assert cfg.train.micro_batch_size == 2
    assert cfg.optim.adam.lr == 1e-4 and cfg.optim.adam.betas == (0.8, 0.9)
    assert cfg.optim.max_norm == 0.5 and cfg.optim.lr_scheduler == "constant"
    assert cfg.ds.packing_samples is True
    assert cfg.ds.lora.target_modules == ("q_proj", "v_proj")
    # SFT defaults follow OpenRLHF's train_sft
    assert cfg.train.batch_size == 128 and cfg.train.max_epochs == 2 and cfg.data.max_len == 2048
    assert cfg.data.input_template == "User: {}\nAssistant: "


def test_yaml_then_cli_wins(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  model_name_or_path: from_yaml\ndata.dataset: y.jsonl\ntrain:\n  seed: 7\n"
                    "  batch_size: 4\noptim:\n  adam:\n    lr: 0.001\n")
    cfg = parse_args(SFTConfig, ["--config", str(path), "--train.seed", "9"])
    assert cfg.model.model_name_or_path == "from_yaml" and cfg.data.dataset == "y.jsonl"
    assert cfg.train.seed == 9 and cfg.train.batch_size == 4 and cfg.optim.adam.lr == 0.001
    # the resolved config round-trips
    save_yaml(cfg, tmp_path / "resolved.yaml")
    again = parse_args(SFTConfig, ["--config", str(tmp_path / "resolved.yaml")])
    assert again == cfg


def test_yaml_unknown_key_names_file_and_valid_keys(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  batchsize: 4\n")
    with pytest.raises(ConfigError, match=r"bad.yaml.*'batchsize'.*batch_size"):
        parse_args(SFTConfig, ["--config", str(path)])


def test_legacy_flat_names_warn_and_map():
    notes = []
    argv = rewrite_aliases(["--pretrain", "p", "--save_path=out", "--bf16", "--zero_stage", "3",
                            "--micro_train_batch_size", "4"], warn=notes.append)
    assert argv == ["--model.model_name_or_path", "p", "--ckpt.output_dir=out", "--ds.param_dtype", "bf16",
                    "--ds.zero_stage", "3", "--train.micro_batch_size", "4"]
    assert len(notes) == 5 and all("deprecated" in n for n in notes)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--ds.ring_attn_size", "2"], "ring_attn_size 2 needs --ds.packing_samples"),
        (["--ds.ring_attn_size", "2", "--ds.packing_samples"], "ring_attn_size 2 must divide the 1 training ranks"),
        (["--ds.ring_attn_head_stride", "0"], "ring_attn_head_stride must be >= 1"),
        (["--train.max_tokens_per_device", "4096"], "needs --ds.packing_samples"),
        (["--data.input_template", "no placeholder"], "must contain"),
        (["--ds.zero_stage", "4"], "must be 0, 1, 2 or 3"),
        (["--data.dataset_probs", "0.5,0.5"], "2 values for 1 datasets"),
    ],
)
def test_validation_messages(extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(SFTConfig, BASE + extra)


def test_required_model():
    with pytest.raises(ConfigError, match="model_name_or_path is required"):
        parse_args(SFTConfig, ["--data.dataset", "x"])


def test_batch_plan_arithmetic():
    plan = plan_batches(num_samples=100, batch_size=8, micro_batch_size=2, world_size=2, max_epochs=3)
    # 8 samples / (2 ranks) = 4 per rank = 2 micro-batches of 2; 100 // 8 = 12 steps/epoch; 36 total
    assert (plan.per_rank_batch, plan.grad_accum_steps, plan.steps_per_epoch, plan.total_steps) == (4, 2, 12, 36)
    assert plan_batches(num_samples=100, batch_size=8, micro_batch_size=2, world_size=1, max_epochs=3,
                        max_steps=5).total_steps == 5
    with pytest.raises(ConfigError, match=r"batch_size 8 is not divisible by train.micro_batch_size 3 x 2 ranks = 6"):
        plan_batches(num_samples=100, batch_size=8, micro_batch_size=3, world_size=2, max_epochs=1)
    with pytest.raises(ConfigError, match="has 5 samples, fewer than one optimizer step"):
        plan_batches(num_samples=5, batch_size=8, micro_batch_size=1, world_size=1, max_epochs=1)


def test_every_openrlhf_sft_flag_is_accepted():
    """Each train_sft flag parses; a value our validation refuses gets a message naming the flag."""
    from tests.flag_tables import check_every_flag

    values = {"--adam.betas": ["0.9", "0.95"], "--data.input_template": ["Q {} A"], "--data.dataset_probs": ["1.0"],
              "--ds.lora.target_modules": ["q_proj", "v_proj"], "--lr_scheduler": ["cosine"]}
    check_every_flag(SFTConfig, "train_sft", 77, BASE, values)


def test_muon_with_max_norm_prints_one_notice(capsys):
    capsys.readouterr()
    assert parse_args(SFTConfig, BASE + ["--optim", "muon"]).optim.name == "muon"
    lines = [x for x in capsys.readouterr().err.splitlines() if "muon" in x.lower()]
    assert len(lines) == 1 and "--optim.max_norm 0 is recommended" in lines[0], lines
    parse_args(SFTConfig, BASE + ["--optim", "muon", "--max_norm", "0"])
    assert "muon" not in capsys.readouterr().err.lower()


def test_unsupported_values_fail_clearly():
    with pytest.raises(ConfigError, match="aux_loss_coef must be >= 0"):
        parse_args(SFTConfig, BASE + ["--model.aux_loss_coef", "-0.1"])



@pytest.mark.parametrize("config", ["sft", "rm", "dpo"])
def test_aux_loss_with_ring_attention_is_refused_at_start_up(config):
    from rlhforge.config.dpo import DPOConfig
    from rlhforge.config.rm import RMConfig

    cls = {"sft": SFTConfig, "rm": RMConfig, "dpo": DPOConfig}[config]
    with pytest.raises(ConfigError, match="aux_loss_coef cannot be combined with --ds.ring_attn_size 2"):
        parse_args(cls, BASE + ["--model.aux_loss_coef", "0.01", "--ds.ring_attn_size", "2", "--ds.packing_samples"])
