"""RL with images on a tiny Qwen2-VL: the HF engine generates with the prompts' pixels, the trainer's
forward sees the same pixels (rollout vs train log-probs), GRPO steps through the CLI in one process and
as 2 Ray workers (equal), the frozen vision tower stays bit-identical, the export reloads; refusals."""

import asyncio
import json
from pathlib import Path

import pytest
import torch

from rlhforge.cli.train_ppo_ray import main
from rlhforge.data.images import vision_batch
from rlhforge.data.packing import collate_padded
from rlhforge.data.records import record_ref
from rlhforge.data.vlm_prompts import vlm_prompt
from rlhforge.models.forward import token_logprobs
from rlhforge.rollout.engine import SamplingParams
from rlhforge.rollout.hf_engine import HFEngine
from tests.rl.helpers import per_step
from tests.vlm_helpers import COLOURS, shape_image

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REWARD = '''
def reward_func(queries, prompts, labels, **kwargs):
    # the colour named, plus a deterministic spread so an untrained model gets non-zero advantages
    r = [float(l in resp) + (len(resp) % 3) / 4 for resp, l in zip(kwargs["responses"], labels)]
    return {"rewards": r, "scores": r}
'''


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from rlhforge.models.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model", arch="qwen2_vl", seed=0)


@pytest.fixture(scope="module")
def processor(vlm_dir):
    from rlhforge.models.vlm import load_processor

    return load_processor(str(vlm_dir))


@pytest.fixture(scope="module")
def rl_data(tmp_path_factory):
    """12 one-image prompts (colour of the square, label = the colour) and one text-only prompt; a reward file."""
    root = tmp_path_factory.mktemp("vlm_rl_data")
    (root / "img").mkdir()
    rows = []
    for i in range(12):
        colour = list(COLOURS)[i % 3]
        shape_image(colour, "square", (56, 56), seed=i).save(root / f"img/{i}.png")
        rows.append({"prompt": "<image>What colour is the shape?", "images": [f"img/{i}.png"], "answer": colour})
    rows.append({"prompt": "Say a colour.", "answer": "red"})
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "reward.py").write_text(REWARD)
    return root


def _prompts(processor):
    recs = [{"prompt": "What colour?", "images": [shape_image("red", size=(56, 56))]},
            {"prompt": "Hi there, say something long"},
            {"prompt": "<image> and <image>: which is blue?",
             "images": [shape_image("blue", size=(28, 56), seed=1), shape_image("green", "circle", (42, 42), seed=2)]}]
    return [vlm_prompt(r, processor, record_ref(r, i), input_key="prompt")[1:] for i, r in enumerate(recs)]


#: image tokens per prompt of _prompts, by hand. Qwen2-VL (patch 14, merge 2, min_pixels 28*28):
#: 56x56 -> 4, 28x56 + 42x42 -> 2 + 4. Qwen3-VL (patch 16: sides to multiples of 32): 56x56 -> 64x64: 4,
#: 28x56 -> 32x64: 2, 42x42 -> 32x32: 1
IMAGE_TOKENS = {"qwen2_vl": [4, 0, 6], "qwen3_vl": [4, 0, 3]}


@pytest.mark.parametrize("arch", list(IMAGE_TOKENS))
def test_engine_generates_with_the_pixels_the_trainer_sees(vlm_dir, tmp_path, arch):
    from transformers import AutoModelForImageTextToText

    from rlhforge.models.tiny_vlm import build_tiny_vlm
    from rlhforge.models.vlm import load_processor

    path = vlm_dir if arch == "qwen2_vl" else build_tiny_vlm(tmp_path / arch, arch=arch, seed=0)
    processor = load_processor(str(path))
    model = AutoModelForImageTextToText.from_pretrained(str(path)).eval()
    engine = HFEngine.from_model(model, processor)
    ids, vision = map(list, zip(*_prompts(processor)))
    assert [v.num_tokens if v else 0 for v in vision] == IMAGE_TOKENS[arch]  # expanded to the feature count
    assert [sum(t == processor.image_token_id for t in p) for p in ids] == IMAGE_TOKENS[arch]
    params = [SamplingParams(10, temperature=1.0, seed=s) for s in range(3)]
    outs = asyncio.run(engine.generate(ids, params, vision=vision))
    assert all(len(o.token_ids) == 10 for o in outs)
    banned = set(processor.placeholder_token_ids)
    assert not banned & {t for o in outs for t in o.token_ids}
    # the trainer's padded forward on prompt + response with the same pixels gives the engine's log-probs
    batch = collate_padded([{"input_ids": p + o.token_ids, "loss_mask": [0] * len(p) + [1] * len(o.token_ids)}
                            for p, o in zip(ids, outs)], processor.pad_token_id)
    batch.update(vision_batch(batch["input_ids"], vision, processor.image_token_id))
    with torch.no_grad():
        lp = token_logprobs(model, batch)
    for b, (p, o) in enumerate(zip(ids, outs)):
        got = lp[b, len(p): len(p) + len(o.token_ids)]
        assert torch.allclose(got, torch.tensor(o.logprobs), atol=1e-5), b
    # each request's tokens do not depend on the batch: alone, the two-image prompt samples the same
    solo = asyncio.run(engine.generate([ids[2]], [params[2]], vision=[vision[2]]))[0]
    assert solo.token_ids == outs[2].token_ids
    # the pixels matter: the same ids with another image's pixels give other greedy log-probs
    other = _prompts(processor)[0][1]
    swapped = type(other)(other.pixel_values.flip(0), other.image_grid_thw, None, other.merge_size)
    greedy = SamplingParams(6, temperature=0.0)
    a = asyncio.run(engine.generate([ids[0]], [greedy], vision=[vision[0]]))[0]
    b = asyncio.run(engine.generate([ids[0]], [greedy], vision=[swapped]))[0]
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) > 1e-4


def _rl_args(vlm_dir, data, out, *extra):
    return ["--actor.model_name_or_path", str(vlm_dir), "--data.prompt_dataset", str(data / "prompts.jsonl"),
            "--data.input_key", "prompt", "--data.label_key", "answer", "--data.apply_chat_template",
            "--reward.remote_url", str(data / "reward.py"), "--rollout.batch_size", "4",
            "--rollout.n_samples_per_prompt", "2", "--rollout.max_new_tokens", "6", "--train.batch_size", "8",
            "--train.micro_batch_size", "4", "--rollout.micro_batch_size", "4",
            "--algo.advantage.estimator", "group_norm", "--actor.adam.lr", "1e-3", "--actor.lr_warmup_ratio", "0",
            "--train.max_steps", "2", "--ckpt.output_dir", str(out), "--train.seed", "3",
            "--actor.freeze_visual_encoder", "--data.max_images_per_prompt", "2", *extra]


def _weights(path):
    from safetensors.torch import load_file

    return load_file(Path(path) / "model.safetensors")


def test_grpo_with_images_through_the_cli(vlm_dir, rl_data, tmp_path):
    from transformers import AutoModelForImageTextToText

    from rlhforge.models.vlm import load_processor

    out = tmp_path / "run"
    assert main(_rl_args(vlm_dir, rl_data, out, "--ds.packing_samples")) == 0  # packing: a notice, padded batches
    # the trainer's forward saw the engine's pixels: rollout and train log-probs agree (a wrong or missing
    # image would move them by ~1e-2, see the engine test)
    for step, gap in per_step(out, "rollout/logprob_diff_rollout_vs_train").items():
        assert gap < 1e-5, step
    assert per_step(out, "actor/kl_ref")[2] > 1e-5  # the reference ran too, and the policy moved
    before, after = _weights(vlm_dir), _weights(out)
    tower = [k for k in before if k.startswith("visual.")]
    assert tower and all(torch.equal(before[k], after[k]) for k in tower)  # frozen: bit-identical
    moved = [k for k in before if not k.startswith("visual.") and not torch.equal(before[k], after[k])]
    assert len(moved) > 10
    reloaded = AutoModelForImageTextToText.from_pretrained(str(out))
    assert type(reloaded).__name__ == "Qwen2VLForConditionalGeneration"
    image = shape_image("blue", size=(56, 84))
    a, b = load_processor(str(out)).image_processor(images=[image], return_tensors="pt"), \
        load_processor(str(vlm_dir)).image_processor(images=[image], return_tensors="pt")
    assert torch.equal(a["image_grid_thw"], b["image_grid_thw"]) and torch.equal(a["pixel_values"], b["pixel_values"])
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert any("<|image_pad|>" in s["prompt"] for s in samples)


def test_resume_with_images_matches_the_straight_run(vlm_dir, rl_data, tmp_path, capsys):
    """3 steps straight vs stop after step 2 and resume: the same rollouts (the prompts' images are read
    again from the data) and the same updates."""
    import shutil

    extra = ["--ckpt.save_steps", "2", "--ckpt.max_num", "3", "--ckpt.path", str(tmp_path / "straight" / "ckpts"),
             "--train.max_steps", "3"]
    straight = tmp_path / "straight"
    assert main(_rl_args(vlm_dir, rl_data, straight, *extra)) == 0
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "ckpts" / "step_3", ignore_errors=True)
    (resumed / "ckpts" / "latest").write_text("step_2")
    extra[extra.index("--ckpt.path") + 1] = str(resumed / "ckpts")
    capsys.readouterr()
    assert main(_rl_args(vlm_dir, rl_data, resumed, *extra, "--ckpt.load_enable")) == 0
    assert "resuming from" in capsys.readouterr().out  # from step 2's state, not from scratch
    assert [json.loads(x)["step"] for x in (resumed / "metrics.jsonl").read_text().splitlines()][-1:] == [3]
    for key in ("rollout/reward_mean", "actor/policy_loss", "actor/grad_norm", "actor/kl_ref"):
        a, b = per_step(straight, key), per_step(resumed, key)
        assert b[3] == pytest.approx(a[3], rel=1e-6, abs=1e-9), key
    wa, wb = _weights(straight), _weights(resumed)
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)


@pytest.mark.slow
def test_ray_workers_with_images_match_one_process(ray_module, vlm_dir, rl_data, tmp_path):
    ray = ray_module
    if not ray.is_initialized():
        from tests.conftest import ray_init_local

        ray_init_local(ray, num_cpus=2)
    single = tmp_path / "single"
    assert main(_rl_args(vlm_dir, rl_data, single, "--ds.strategy", "deepspeed", "--ds.zero_stage", "2",
                         "--train.workers", "local")) == 0
    dp = tmp_path / "ray"
    assert main(_rl_args(vlm_dir, rl_data, dp, "--ds.strategy", "deepspeed", "--ds.zero_stage", "2",
                         "--actor.num_gpus_per_node", "2", "--train.colocate_all")) == 0
    assert per_step(dp, "rollout/reward_mean") == per_step(single, "rollout/reward_mean")
    for key in ("actor/grad_norm", "actor/kl_ref", "actor/policy_loss"):
        a, b = per_step(single, key), per_step(dp, key)
        for step in (1, 2):
            assert b[step] == pytest.approx(a[step], rel=1e-3, abs=1e-5), (key, step)
    wa, wb = _weights(single), _weights(dp)
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-4


@pytest.mark.parametrize("extra, needle", [
    (["--algo.advantage.estimator", "gae"], "needs a critic"),
    (["--ds.ring_attn_size", "2", "--actor.num_gpus_per_node", "2", "--ds.packing_samples"], "ring_attn_size"),
])
def test_vlm_refusals(vlm_dir, rl_data, tmp_path, capsys, extra, needle):
    with pytest.raises(SystemExit) as exit_info:
        main(_rl_args(vlm_dir, rl_data, tmp_path / "x", *extra))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "is a vision-language model" in err and needle in err


def test_vllm_engines_with_a_vlm_need_a_torchvision_vllm_can_use(vllm, vlm_dir, rl_data, tmp_path, capsys):
    # (the ``vllm`` fixture: without vLLM the run stops earlier, at "needs vLLM", a refusal tested elsewhere)
    from rlhforge.rollout.vllm_vision import vlm_unsupported_reason

    if vlm_unsupported_reason() is None:
        pytest.skip("torchvision imports here: vLLM can serve the VLM (tests/rl/test_vllm_vlm.py)")
    with pytest.raises(SystemExit) as exit_info:
        main(_rl_args(vlm_dir, rl_data, tmp_path / "x", "--vllm.num_engines", "1"))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--vllm.num_engines 1" in err and "torchvision" in err and "--vllm.num_engines 0" in err


ENV = '''
from PIL import Image
from rlhforge.agents import AgentInstanceBase


class AgentInstance(AgentInstanceBase):
    async def reset(self, states, **kwargs):
        self.turn = 0  # short actions: an untrained model never stops, and the feedback image needs room
        return {"observation": states["observation"], "sampling_params": {"max_tokens": 6}}

    async def step(self, states, **kwargs):
        self.turn += 1
        if self.turn == 1:  # a second look: the feedback carries an image (28x56 -> 2 image tokens)
            return {"rewards": 0.0, "environment_feedback": "Look again: <image> What colour?",
                    "environment_images": [Image.new("RGB", (28, 56), (40, 70, 220))], "done": False,
                    "sampling_params": {"max_tokens": 6}}
        hit = float(states["label"] in states["action_text"])
        return {"rewards": hit + len(states["action_text"]) % 3 / 4, "scores": hit, "environment_feedback": "",
                "done": True}
'''


def test_multi_turn_grpo_with_feedback_images(vlm_dir, rl_data, tmp_path):
    env = tmp_path / "env.py"
    env.write_text(ENV)
    out = tmp_path / "mt"
    assert main(_rl_args(vlm_dir, rl_data, out, "--train.agent_func_path", str(env), "--rollout.max_new_tokens",
                         "24")) == 0
    # every episode appended the feedback image (2 tokens + start/end), and the trainer's forward saw its
    # pixels: the rollout-vs-train log-prob gap stays at float noise over both actions
    assert per_step(out, "rollout/agent_env_images") == {1: 1.0, 2: 1.0}
    for step, gap in per_step(out, "rollout/logprob_diff_rollout_vs_train").items():
        assert gap < 1e-5, step
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert all("Look again: <|vision_start|><|image_pad|><|image_pad|><|vision_end|>" in s["response"]
               for s in samples)


def test_a_bad_image_in_the_prompts_stops_at_start_up(vlm_dir, rl_data, tmp_path, capsys):
    bad = rl_data / "bad.jsonl"  # beside the images: paths are relative to the data file
    rows = [json.loads(x) for x in (rl_data / "prompts.jsonl").read_text().splitlines()[:3]]
    rows[1]["images"] = [str(rl_data / "img" / "missing.png")]
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = _rl_args(vlm_dir, rl_data, tmp_path / "x")
    args[args.index("--data.prompt_dataset") + 1] = str(bad)
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "bad.jsonl" in err and "record 1" in err and "images[0]" in err and "image file not found" in err


def test_openai_agents_are_refused_with_a_vlm(vlm_dir, rl_data, tmp_path, capsys):
    agent = tmp_path / "agent.py"
    agent.write_text("async def run_agent(prompt, label, client):\n    return 0.0\n")
    with pytest.raises(SystemExit) as exit_info:
        main(_rl_args(vlm_dir, rl_data, tmp_path / "x", "--train.agent_func_path", str(agent)))
    assert exit_info.value.code == 2
    assert "do not carry images yet" in capsys.readouterr().err


def test_freeze_visual_encoder_on_a_text_model(tiny_model_dir, rl_data, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(_rl_args(tiny_model_dir, rl_data, tmp_path / "x"))
    assert exit_info.value.code == 2
    assert "--actor.freeze_visual_encoder" in capsys.readouterr().err
