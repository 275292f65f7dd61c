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
