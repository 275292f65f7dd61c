"""The placement plan (engines, colocation, the resource check) and ``--train.plan_only``."""

from __future__ import annotations

import pytest

from rlhforge.config.parsing import ConfigError
from rlhforge.distributed.placement import EnginePlacement, check_resources, plan_placement

SEED = {"actor": 8, "ref": 8, "critic": 8, "reward": 8}


def test_engines_get_their_own_groups_without_colocation():
    p = plan_placement(SEED, device="cuda", num_engines=4, engine_tp=2)
    assert p.bundles == {"actor": 8, "ref": 8, "critic": 8, "reward": 8,
                         "engine0": 2, "engine1": 2, "engine2": 2, "engine3": 2}
    assert p.total_bundles == 40
    assert p.engines[3] == EnginePlacement(index=3, pg="engine3", bundle_indices=(0, 1), share=1.0)
    assert all(g.share == 1.0 for g in p.groups.values())


def test_defaults_keep_the_old_plans():
    p = plan_placement({"actor": 2, "ref": 2, "critic": 2}, device="cpu", colocate_all=True)
    assert p.bundles == {"all": 2} and p.engines == () and p.groups["actor"].share == pytest.approx(1 / 3)


def test_colocate_all_puts_engines_on_consecutive_bundles():
    p = plan_placement(SEED, device="cuda", colocate_all=True, num_engines=4, engine_tp=2)
    assert p.bundles == {"all": 8}
    assert [e.bundle_indices for e in p.engines] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    # 4 models + the engines (one member) share each bundle: 1/5 each, as OpenRLHF's 0.2
    assert {g.share for g in p.groups.values()} == {0.2} and {e.share for e in p.engines} == {0.2}
    assert p.members("all")[:4] == ["actor", "ref", "critic", "reward"]
    # GRPO: no critic, no reward model -> actor + ref + engines
    p = plan_placement({"actor": 8, "ref": 8}, device="cuda", colocate_all=True, num_engines=8, engine_tp=1)
    assert p.engines[7].bundle_indices == (7,) and p.engines[0].share == pytest.approx(1 / 3)
    with pytest.raises(ConfigError, match=r"4 engines x TP 4 = 16 bundles, but the shared group has 8"):
        plan_placement(SEED, device="cuda", colocate_all=True, num_engines=4, engine_tp=4)


def test_colocate_critic_reward():
    p = plan_placement(SEED, device="cuda", colocate_critic_reward=True, colocate_actor_ref=True)
    assert p.bundles == {"actor": 8, "critic": 8}
    assert p.groups["reward"].pg == "critic" and p.groups["reward"].share == 0.5 and p.groups["ref"].pg == "actor"
    with pytest.raises(ConfigError, match=r"colocate_critic_reward needs as many reward workers as critic workers "
                                          r"\(critic 8, reward 4\)"):
        plan_placement({"actor": 8, "critic": 8, "reward": 4}, device="cuda", colocate_critic_reward=True)
    # no critic (GRPO): the reward model keeps its own group
    assert plan_placement({"actor": 2, "reward": 2}, device="cpu", colocate_critic_reward=True).bundles == \
        {"actor": 2, "reward": 2}


def test_resource_check_spells_out_the_arithmetic():
    p = plan_placement(SEED, device="cuda", num_engines=4, engine_tp=2)
    with pytest.raises(ConfigError) as err:
        check_resources(p, {"GPU": 8.0, "CPU": 16.0})
    assert str(err.value) == ("the Ray workers need 40 GPU bundle(s): 4 engines x TP 2 = 8 GPUs plus actor 8 + ref 8 + "
                              "critic 8 + reward 8 without colocation = 40; the Ray cluster has 8 free GPU(s): "
                              "add --train.colocate_all")
    # the flag that would make it fit: colocating actor + ref is enough here
    p = plan_placement({"actor": 2, "ref": 2, "critic": 2}, device="cpu")
    with pytest.raises(ConfigError, match=r"= 6; the Ray cluster has 4 free CPU\(s\): add --train.colocate_actor_ref$"):
        check_resources(p, {"CPU": 4.0})
    # nothing would make it fit
    p = plan_placement(SEED, device="cuda", colocate_all=True, num_engines=4, engine_tp=2)
    with pytest.raises(ConfigError, match=r"\(actor \+ ref \+ critic \+ reward \+ 4 engines x TP 2 sharing 8\) with "
                                          r"--train.colocate_all = 8; the Ray cluster has 4 free GPU\(s\): use fewer"):
        check_resources(p, {"GPU": 4.0, "CPU": 16.0})
    check_resources(p, {"GPU": 8.0, "CPU": 16.0})
    with pytest.raises(ConfigError, match=r"has 4 free CPU\(s\) for them"):
        check_resources(p, {"GPU": 8.0, "CPU": 4.0})
