"""Data read exactly as written, and bad data files stopped at start-up with where they are wrong.

Through every training command's ``main(argv)`` (SFT, RM, DPO, RL): a byte that is not UTF-8 and a
record whose field has the wrong type give exit 2 and a message naming the file, the line (or
record) and the field. Through a real RL run on the tiny model: a label column that mixes strings,
numbers, booleans and nulls reaches the reward function with every value unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhforge.cli import train_dpo, train_ppo_ray, train_rm, train_sft
from tests.rl.helpers import rl_args, write_reward


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _replace(args: list[str], flag: str, value: str) -> list[str]:
    args = list(args)
    args[args.index(flag) + 1] = value
    return args


def _sft(model, data, out):
    return ["--model.model_name_or_path", str(model), "--data.dataset", str(data), "--data.input_key", "prompt",
            "--data.output_key", "answer", "--train.batch_size", "2", "--train.micro_batch_size", "2",
            "--train.max_steps", "1", "--ckpt.output_dir", str(out), "--logger.progress_bar", "off"]


def _pairs(model, data, out):
    return ["--model.model_name_or_path", str(model), "--data.dataset", str(data), "--data.prompt_key", "prompt",
            "--data.chosen_key", "chosen", "--data.rejected_key", "rejected", "--train.batch_size", "2",
            "--train.micro_batch_size", "2", "--train.max_steps", "1", "--ckpt.output_dir", str(out),
            "--logger.progress_bar", "off"]


def _rl(model, data, out):
    return _replace(rl_args(model, out, steps=1), "--data.prompt_dataset", str(data))


COMMANDS = {
    # name: (main, argv builder, a good record, the field a wrong-typed record gets wrong, its bad value)
    "sft": (train_sft.main, _sft, {"prompt": "What is 1 + 1?", "answer": "2"}, "answer", 2),
    "rm": (train_rm.main, _pairs, {"prompt": "1 + 1?", "chosen": "2", "rejected": "3"}, "rejected", 3),
    "dpo": (train_dpo.main, _pairs, {"prompt": "1 + 1?", "chosen": "2", "rejected": "3"}, "prompt", 11),
    "rl": (train_ppo_ray.main, _rl, {"prompt": "What is 1 + 1?", "answer": "2"}, "prompt", 12),
}


def _exit_code_and_error(main, argv, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    return exc.value.code, capsys.readouterr().err


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_byte_that_is_not_utf8_is_exit_2_naming_file_line_and_offset(command, tiny_model_dir, tmp_path, capsys):
    main, build, good, *_ = COMMANDS[command]
    path = tmp_path / "latin1.jsonl"
    lines = [json.dumps(good).encode()] * 3
    lines[2] = lines[2].replace(b'"2"', b'"caf\xe9"').replace(b'"3"', b'"caf\xe9"')
    assert b"\xe9" in lines[2]
    path.write_bytes(b"\n".join(lines) + b"\n")
    offset = path.read_bytes().index(b"\xe9")
    code, err = _exit_code_and_error(main, build(tiny_model_dir, path, tmp_path / "out"), capsys)
    assert code == 2, err
    assert f"{path}, line 3: is not valid UTF-8: byte 0xe9 at byte offset {offset}" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_wrong_typed_field_is_exit_2_naming_record_line_and_field(command, tiny_model_dir, tmp_path, capsys):
    main, build, good, field, bad_value = COMMANDS[command]
    path = tmp_path / "typed.jsonl"
    rows = [json.dumps(good)] * 4
    rows[3] = json.dumps({**good, field: bad_value})  # line 5 (a blank line before it), record 3
    path.write_text("\n".join(rows[:3]) + "\n\n" + rows[3] + "\n")
    code, err = _exit_code_and_error(main, build(tiny_model_dir, path, tmp_path / "out"), capsys)
    assert code == 2, err
    assert f"{path}, record 3, field '{field}': expected " in err and f"got int ({bad_value})" in err, err
    assert "[line 5]" in err and "Traceback" not in err


def test_messages_that_are_not_a_list_are_exit_2_at_their_record(tiny_model_dir, tmp_path, capsys):
    path = tmp_path / "chat.jsonl"
    ok = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path.write_text("\n".join(json.dumps(r) for r in [ok, ok, {"messages": {"role": "user"}}]) + "\n")
    argv = _replace(_sft(tiny_model_dir, path, tmp_path / "out"), "--data.input_key", "messages")
    argv = [a for a in argv if a not in ("--data.output_key", "answer")] + ["--data.apply_chat_template"]
    code, err = _exit_code_and_error(train_sft.main, argv, capsys)
    assert code == 2, err
    assert f"{path}, record 2, field 'messages': expected a list of" in err and "[line 3]" in err


RECORDING_REWARD = '''
import json

def reward_func(queries, prompts, labels, **kwargs):
    with open({log!r}, "a") as f:
        for p, label in zip(prompts, labels):
            f.write(json.dumps({{"prompt": p, "label": label}}) + "\\n")
    rewards = [(len(r) % 3) / 2.0 for r in kwargs["responses"]]
    return {{"rewards": rewards, "scores": rewards}}
'''

# label values as the file holds them: strings that look like numbers/booleans/null stay strings
LABELS = ["0.50", 7, "true", None, "1e3", 1e3, True, "null"]


def test_mixed_type_labels_reach_the_reward_function_unchanged(tiny_model_dir, tmp_path):
    data = tmp_path / "labels.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"item{i} What is {i}?", "answer": label}) + "\n"
                            for i, label in enumerate(LABELS)))
    log = tmp_path / "labels_seen.jsonl"
    reward = write_reward(tmp_path / "reward.py", RECORDING_REWARD.format(log=str(log)))
    out = tmp_path / "run"
    argv = _replace(_rl(tiny_model_dir, data, out), "--reward.remote_url", str(reward))
    argv = _replace(argv, "--train.max_steps", "2")  # 2 steps x 4 prompts: every prompt once (one episode)
    assert train_ppo_ray.main(argv) == 0
    seen = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(seen) == 16  # 8 prompts x 2 samples
    by_item: dict[int, list] = {}
    for rec in seen:
        (i,) = [i for i in range(len(LABELS)) if f"item{i} " in rec["prompt"]]
        by_item.setdefault(i, []).append(rec["label"])
    assert sorted(by_item) == list(range(len(LABELS)))
    for i, labels in by_item.items():
        # exact JSON values, types included (json.dumps keeps "7" vs 7, 1000.0 vs 1000, true vs "true")
        assert [json.dumps(x) for x in labels] == [json.dumps(LABELS[i])] * 2, (i, labels)
    assert Path(out / "metrics.jsonl").exists()
