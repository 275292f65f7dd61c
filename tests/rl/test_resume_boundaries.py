"""Resume at the boundaries where work could be skipped or repeated silently (docs/reliability.md).

- async with batches queued past the checkpoint: the resumed run says so, regenerates exactly the
  prompts of the steps left (same prompts, same order as the uninterrupted run: none skipped, none
  repeated) and ends at the same stream position;
- after the last step: one line says nothing is left; nothing is trained or logged again.
(Mid-epoch: tests/trainers/test_sft.py; an epoch boundary: tests/faults/test_resume_edges.py;
mid-rollout with buffered prompt groups: tests/rl/test_oversampling.py.)
"""

from __future__ import annotations

import json
import shutil

import pytest

from rlhforge.cli.train_ppo_ray import main as rl_main
from tests.rl.helpers import per_step, rl_args, write_reward

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(600)]


def _prompts_by_step(run) -> dict[int, list]:
    out: dict[int, list] = {}
    for line in (run / "samples.jsonl").read_text().splitlines():
        r = json.loads(line)
        out.setdefault(r["step"], []).append((r["prompt"], r["label"]))
    return out


def _state(run, step) -> dict:
    return json.loads((run / "ckpts" / f"step_{step}" / "trainer_state.json").read_text())


@pytest.fixture(scope="module")
def async_run(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("async_resume")
    reward = str(write_reward(root / "r.py"))
    extra = ["--reward.remote_url", reward, "--train.async_enable", "--train.async_queue_size", "2",
             "--ckpt.save_steps", "2", "--ckpt.max_num", "5", "--rollout.batch_size", "2"]
    straight = root / "straight"
    assert rl_main(rl_args(tiny_model_dir, straight, *extra, steps=4)) == 0
    return straight, extra


def test_async_queue_non_empty_at_the_checkpoint(tiny_model_dir, async_run, tmp_path, capsys):
    straight, extra = async_run
    staleness = per_step(straight, "async/staleness")
    # batch 3 was generated with weights version <= 1, i.e. before step 2 ended: it sat in the queue when
    # step 2's checkpoint was written (and the old run trained it)
    assert staleness[3] == 2, staleness
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "ckpts" / "step_4")
    (resumed / "ckpts" / "latest").write_text("step_2")
    (resumed / "samples.jsonl").write_text("".join(
        x + "\n" for x in (straight / "samples.jsonl").read_text().splitlines() if json.loads(x)["step"] <= 2))
    capsys.readouterr()
    args = rl_args(tiny_model_dir, resumed, *extra, "--ckpt.load_enable", steps=4)
    args[args.index("--ckpt.path") + 1] = str(resumed / "ckpts")
    assert rl_main(args) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[rlhforge] resuming from")]
    pos = _state(straight, 2)["prompt_position"]
    assert line.startswith(f"[rlhforge] resuming from {resumed / 'ckpts' / 'step_2'}: steps 1-2 of 4 are done; "
                           f"next is step 3; prompts continue at stream position {pos} ")
    assert "async: batches the old run had queued past this step are generated again" in line
    # no prompt skipped, none repeated: steps 3 and 4 train the uninterrupted run's prompts, and the run
    # ends at its stream position; the regenerated batch 3 is fresh (staleness 0, not 2)
    a, b = _prompts_by_step(straight), _prompts_by_step(resumed)
    assert sorted(b) == [1, 2, 3, 4] and b[3] == a[3] and b[4] == a[4]
    assert _state(resumed, 4)["prompt_position"] == _state(straight, 4)["prompt_position"]
    assert sorted(per_step(resumed, "async/staleness")) == [1, 2, 3, 4]
    assert per_step(resumed, "async/staleness")[3] == 0


def test_after_the_last_step_nothing_is_trained_again(tiny_model_dir, async_run, tmp_path, capsys):
    straight, extra = async_run
    done = tmp_path / "done"
    shutil.copytree(straight, done)
    metrics_before = (done / "metrics.jsonl").read_text()
    samples_before = (done / "samples.jsonl").read_text()
    capsys.readouterr()
    args = rl_args(tiny_model_dir, done, *extra, "--ckpt.load_enable", steps=4)
    args[args.index("--ckpt.path") + 1] = str(done / "ckpts")
    assert rl_main(args) == 0
    out = capsys.readouterr().out
    assert (f"[rlhforge] resume: {done / 'ckpts' / 'step_4'} is the run's last step (4 of 4): nothing left to "
            "train") in out
    assert (done / "metrics.jsonl").read_text() == metrics_before
    assert (done / "samples.jsonl").read_text() == samples_before
    assert (done / "model.safetensors").read_bytes() == (straight / "model.safetensors").read_bytes()
