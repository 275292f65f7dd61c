"""Oversampling (--rollout.vllm_generate_batch_size above rollout.batch_size): accepted surplus prompt
groups are buffered for the next steps; every prompt taken from the stream is trained on once,
buffered or rejected, never twice, and a resume neither skips nor repeats a buffered prompt."""

import json
import shutil

import pytest

from rlhforge.cli.train_ppo_ray import main as rl_main
from rlhforge.trainers.rl.prompts import GroupBuffer, PromptStream, gather_groups
from tests.rl.helpers import per_step, rl_args


def _fake_generate(log):
    """One 'group' per position: the position itself, twice (n = 2); records every call's positions."""
    def generate(idx, positions):
        log.append(list(positions))
        return [[p, p] for p in positions]
    return generate


def _reject_3_mod_4(group) -> bool:
    return group[0] % 4 != 3


def _steps(stream, buffer, k, log, round_size=3):
    out = []
    for _ in range(k):
        got = gather_groups(stream, buffer, need=2, round_size=round_size, generate=_fake_generate(log),
                            accept=_reject_3_mod_4, max_refills=8)
        out.append((got.positions, got.new_prompts, got.from_buffer, got.rounds, buffer.positions()))
    return out


# worked by hand: need 2, 3 prompts per call, positions 3, 7, 11, ... rejected
EXPECTED = [  # (trained positions, new prompts taken, groups from the buffer, calls, buffer after)
    ([0, 1], 3, 0, 1, [2]),
    ([2, 4], 3, 1, 1, [5]),
    ([5, 6], 3, 1, 1, [8]),
    ([8, 9], 3, 1, 1, [10]),
    ([10, 12], 3, 1, 1, [13, 14]),
    ([13, 14], 0, 2, 0, []),  # the buffer alone fills this step: no engine call
]


def test_buffered_groups_feed_the_next_steps_by_hand():
    log = []
    steps = _steps(PromptStream(100, seed=0), GroupBuffer(), 6, log)
    assert steps == EXPECTED
    trained = [p for s in steps for p in s[0]]
    assert trained == sorted(set(trained))  # oldest first, never twice
    assert sorted(trained + [3, 7, 11]) == list(range(15))  # every prompt taken: trained or rejected
    assert [p for call in log for p in call] == list(range(15))  # each generated exactly once


def test_resume_regenerates_the_buffered_prompts_first():
    log = []
    stream, buffer = PromptStream(100, seed=0), GroupBuffer()
    first = _steps(stream, buffer, 3, log)
    saved_position, saved_buffer = stream.position, buffer.positions()  # what a checkpoint records
    assert (saved_position, saved_buffer) == (9, [8])
    resumed_log = []
    stream2 = PromptStream(100, seed=0, position=saved_position)
    rest = _steps(stream2, GroupBuffer(pending=saved_buffer), 3, resumed_log)
    assert first + rest == EXPECTED
    assert resumed_log[0] == [8]  # the buffered prompt first (at its own stream position: same request seeds)
    assert [p for call in resumed_log for p in call] == [8, *range(9, 15)]


def test_without_oversampling_one_call_asks_for_the_missing_prompts():
    log = []
    stream, buffer = PromptStream(100, seed=0), GroupBuffer()
    steps = _steps(stream, buffer, 3, log, round_size=None)
    # refills replace rejected groups one call at a time; nothing is ever buffered
    assert [s[0] for s in steps] == [[0, 1], [2, 4], [5, 6]]
    assert log == [[0, 1], [2, 3], [4], [5, 6]]
    assert all(s[4] == [] for s in steps)


def test_prompt_index_follows_the_stream_order():
    stream = PromptStream(5, seed=1)
    taken = stream.take(12)
    assert [PromptStream(5, seed=1).index_at(p) for p in range(12)] == taken
    assert sorted(taken[:5]) == list(range(5)) and sorted(taken[5:10]) == list(range(5))


# ------------------------------------------------------------------------------------- end to end

SCORE_BY_LABEL = """
def reward_func(queries, prompts, labels, **kwargs):
    # score (filtering) by the prompt's label alone, so which groups pass does not depend on the model:
    # answers divisible by 3 score 0 (rejected by the range (0, 0.99)), the others 0.5 (accepted)
    scores = [0.0 if int(str(l).strip()) % 3 == 0 else 0.5 for l in labels]
    rewards = [(len(r) % 3) / 2.0 for r in kwargs["responses"]]
    return {"rewards": rewards, "scores": scores}
"""


def _oversampling_args(model_dir, out, reward, steps):
    return rl_args(model_dir, out, "--reward.remote_url", reward, "--rollout.vllm_generate_batch_size", "6",
                   "--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0", "0.99",
                   "--ckpt.save_steps", "2", "--ckpt.max_num", "5", steps=steps)


def _expected(cfg_out, steps):
    """The same accounting recomputed with the pure gatherer over the run's own prompt order and labels."""
    from rlhforge.cli.train_ppo_ray import parse_rl_args
    from rlhforge.models.loading import load_tokenizer
    from rlhforge.trainers.rl.prompts import load_prompts

    cfg = parse_rl_args(cfg_out)
    prompts, _ = load_prompts(cfg, load_tokenizer(cfg.actor.model_name_or_path))
    stream, buffer, out = PromptStream(len(prompts), cfg.train.seed), GroupBuffer(), []

    def generate(idx, positions):
        return [[prompts[i]] for i in idx]

    def accept(group):
        return int(str(group[0].label).strip()) % 3 != 0

    for _ in range(steps):
        got = gather_groups(stream, buffer, need=4, round_size=6, generate=generate, accept=accept, max_refills=8)
        out.append((got.new_prompts, got.from_buffer, len(buffer.groups), stream.position, buffer.positions()))
    return out


def test_oversampling_run_and_resume_account_for_every_prompt(tiny_model_dir, tmp_path, capsys):
    reward = tmp_path / "reward.py"
    reward.write_text(SCORE_BY_LABEL)
    straight = tmp_path / "straight"
    args = _oversampling_args(tiny_model_dir, straight, reward, 4)
    assert rl_main(args) == 0
    expected = _expected(args, 4)
    consumed = per_step(straight, "rollout/prompts_consumed")
    assert [consumed[s] for s in (1, 2, 3, 4)] == [e[0] for e in expected]
    assert [per_step(straight, "rollout/groups_from_buffer")[s] for s in (1, 2, 3, 4)] == [e[1] for e in expected]
    assert [per_step(straight, "rollout/buffered_groups")[s] for s in (1, 2, 3, 4)] == [e[2] for e in expected]
    assert all(v == 8 for v in per_step(straight, "rollout/samples").values())  # 4 groups x 2 samples every step
    assert sum(e[1] for e in expected) > 0  # the buffer really fed later steps
    state = json.loads((straight / "ckpts" / "step_2" / "trainer_state.json").read_text())
    assert (state["prompt_position"], state["buffered_positions"]) == (expected[1][3], expected[1][4])

    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "ckpts" / "step_4", ignore_errors=True)
    (resumed / "ckpts" / "latest").write_text("step_2")
    capsys.readouterr()
    assert rl_main(_oversampling_args(tiny_model_dir, resumed, reward, 4) + ["--ckpt.load_enable"]) == 0
    # a checkpoint in the middle of a generation round: the line names what is generated again
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[rlhforge] resuming from")]
    assert "steps 1-2 of 4 are done; next is step 3" in line and f"stream position {expected[1][3]}" in line
    assert f"{len(expected[1][4])} prompt group(s) generated before the checkpoint but not trained" in line
    for key in ("rollout/prompts_consumed", "rollout/groups_from_buffer", "rollout/buffered_groups"):
        a, b = per_step(straight, key), per_step(resumed, key)
        assert [b[s] for s in (3, 4)] == [a[s] for s in (3, 4)], key
    final = json.loads((resumed / "ckpts" / "step_4" / "trainer_state.json").read_text())
    assert (final["prompt_position"], final["buffered_positions"]) == (expected[3][3], expected[3][4])


def test_generate_batch_size_below_one_is_refused(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as err:
        rl_main(rl_args(tiny_model_dir, tmp_path, "--rollout.vllm_generate_batch_size", "0"))
    assert err.value.code == 2
    assert "--rollout.vllm_generate_batch_size must be >= 1" in capsys.readouterr().err
