"""On-policy distillation with the teacher as a Ray worker group (2 replicas, each scoring its shard, colocated
with the actor): the same run as the single-process one on the same seed (tests/rl/test_opd.py proves the reward
itself); and the placement plan puts the teacher where the reference would go."""

import pytest

from rlhforge.cli.train_ppo_ray import main
from rlhforge.config.parsing import ConfigError
from rlhforge.distributed.placement import plan_placement
from rlhforge.models.tiny import TinyModelSpec, build_tiny_model
from tests.rl.helpers import per_step, rl_args

pytestmark = pytest.mark.slow


def test_teacher_is_placed_like_the_reference():
    plan = plan_placement({"actor": 2, "ref": 2, "teacher": 2}, device="cpu", colocate_actor_ref=True)
    assert {g.name: g.pg for g in plan.groups.values()} == {"actor": "actor", "ref": "actor", "teacher": "actor"}
    assert plan.bundles == {"actor": 2} and plan.groups["teacher"].share == pytest.approx(1 / 3)
    apart = plan_placement({"actor": 1, "teacher": 2}, device="cpu")
    assert apart.bundles == {"actor": 1, "teacher": 2}
    with pytest.raises(ConfigError, match="colocate_actor_ref needs as many teacher workers as actor workers"):
        plan_placement({"actor": 1, "teacher": 2}, device="cpu", colocate_actor_ref=True)


def test_plan_report_counts_the_teachers_parameters(tiny_model_dir, tmp_path):
    """--train.plan_only's table has a teacher row (the report reads the teacher's own folder; it had no path for
    a teacher before and raised KeyError), on the actor's bundles with --train.colocate_actor_ref."""
    from rlhforge.cli.train_ppo_ray import parse_rl_args
    from rlhforge.distributed.placement import plan_sizes
    from rlhforge.distributed.plan_report import count_parameters, model_paths, report

    teacher = build_tiny_model(tmp_path / "teacher", TinyModelSpec(num_hidden_layers=4), seed=0)
    cfg = parse_rl_args(["--actor.model_name_or_path", str(tiny_model_dir), "--data.prompt_dataset",
                         "builtin:arithmetic", "--algo.advantage.estimator", "on_policy_distill",
                         "--teacher.model_name_or_path", str(teacher), "--algo.kl.init_coef", "0",
                         "--train.colocate_actor_ref", "--train.plan_only"], validate=False)
    assert plan_sizes(cfg) == {"actor": 1, "teacher": 1}
    text, _ = report(cfg, plan_placement(plan_sizes(cfg), device="cpu", colocate_actor_ref=True), strategy="torch")
    row = next(x for x in text.splitlines() if x.strip().startswith("teacher"))
    assert row.split()[1] == "actor", row
    assert model_paths(cfg)["teacher"] == [str(teacher)]
    assert count_parameters(str(teacher))[0] > count_parameters(str(tiny_model_dir))[0]  # its own size is counted


def test_ray_teacher_group_matches_single_process(ray_cluster, tiny_model_dir, tmp_path):
    teacher = build_tiny_model(tmp_path / "teacher", TinyModelSpec(num_hidden_layers=3), seed=0)

    def run(out, *extra):
        args = rl_args(tiny_model_dir, out, "--teacher.model_name_or_path", str(teacher), "--algo.kl.init_coef", "0",
                       "--ds.strategy", "deepspeed", "--ds.zero_stage", "2", *extra, estimator="on_policy_distill")
        assert main(args) == 0
        return out

    single = run(tmp_path / "single", "--train.workers", "local")
    ray = run(tmp_path / "ray", "--teacher.num_gpus_per_node", "2", "--train.colocate_all")
    assert per_step(ray, "rollout/reward_mean") == per_step(single, "rollout/reward_mean")
    for key in ("distill/reverse_kl", "distill/teacher_logprob", "actor/policy_loss", "actor/grad_norm"):
        a, b = per_step(single, key), per_step(ray, key)
        assert a.keys() == b.keys() == {1, 2}, key
        for step in a:
            assert b[step] == pytest.approx(a[step], rel=1e-3, abs=1e-5), (key, step)
