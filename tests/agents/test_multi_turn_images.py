"""Multi-turn episodes whose environment feedback carries images (OpenRLHF's ``environment_images``),
with a tiny Qwen2-VL and the HF engine: the image tokens land where the feedback's ``<image>`` is, outside
the action spans; the trajectory's images are the prompt's then the feedback's, with the image
processor's pixels; the next turn's engine call gets them (its log-probs are the trainer forward's);
an image over the budget is dropped whole; a text actor given images fails naming the step."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch

from rlhforge.agents import AgentInstanceBase, AgentSettings, MultiTurnAgentExecutor
from rlhforge.agents.batching import BatchingEngine
from rlhforge.agents.episode import Episode, EpisodeContext
from rlhforge.agents.single_turn import PromptRequest
from rlhforge.data.images import VisionInput, vision_batch
from rlhforge.data.records import RecordRef
from rlhforge.data.vlm_prompts import vlm_prompt
from rlhforge.models.forward import token_logprobs
from rlhforge.rollout.engine import SamplingParams
from rlhforge.rollout.hf_engine import HFEngine
from tests.vlm_helpers import shape_image

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT_IMAGE = shape_image("red", size=(56, 56))  # grid 1x4x4 -> 16 patches / 2**2 = 4 image tokens
FEEDBACK_IMAGE = shape_image("blue", "circle", size=(28, 56), seed=3)  # 56 high x 28 wide: 1x4x2 -> 2 tokens
OTHER_IMAGE = shape_image("green", size=(28, 56), seed=4)  # same size as FEEDBACK_IMAGE, other pixels


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from rlhforge.models.tiny_vlm import build_tiny_vlm
    from rlhforge.models.vlm import load_processor

    path = build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "qwen2_vl", arch="qwen2_vl", seed=0)
    proc = load_processor(str(path))
    return HFEngine.from_pretrained(str(path), proc), proc


class _ImageEnv(AgentInstanceBase):
    """Turn 1: feedback ``"Look: <image> now?"`` with one image; turn 2 ends the episode."""

    images: list = [FEEDBACK_IMAGE]

    async def reset(self, states, **kwargs):
        self.turn = 0
        return {"observation": states["observation"], "sampling_params": {"max_tokens": 4}}

    async def step(self, states, **kwargs):
        self.turn += 1
        if self.turn == 1:
            return {"rewards": 0.0, "environment_feedback": "Look: <image> now?", "done": False,
                    "environment_images": list(self.images)}
        return {"rewards": 1.0, "done": True}


def _request(proc, sample: int = 0, question: str = "What colour?") -> PromptRequest:
    record = {"prompt": "<image>" + question, "images": [PROMPT_IMAGE]}
    raw, ids, vision = vlm_prompt(record, proc, RecordRef("<test>", 0), input_key="prompt")
    return PromptRequest(ids, "x", None, 0, sample, raw_prompt=raw, vision=vision)


def _recorder(monkeypatch) -> list:
    """Every (prompt ids, vision, output ids, log-probs) the HF engine produced."""
    calls = []
    original = HFEngine.generate_sync

    def generate_sync(engine, prompts, params, vision=None):
        outs = original(engine, prompts, params, vision)
        for k, (p, o) in enumerate(zip(prompts, outs)):
            calls.append((list(p), None if vision is None else vision[k], list(o.token_ids), list(o.logprobs)))
        return outs

    monkeypatch.setattr(HFEngine, "generate_sync", generate_sync)
    return calls


def _run(engine, tok, requests, max_new=40, env=_ImageEnv, **settings):
    ex = MultiTurnAgentExecutor(env)
    ex.configure(tokenizer=tok, settings=AgentSettings(**{"step_timeout": 30.0, **settings}))
    params = [SamplingParams(max_new_tokens=max_new, seed=7 + k) for k in range(len(requests))]
    return asyncio.run(ex.execute_batch(requests, params, engine))


def _image_tokens(proc, count: int) -> list[int]:
    start, end = proc.convert_tokens_to_ids("<|vision_start|>"), proc.convert_tokens_to_ids("<|vision_end|>")
    return [start] + [proc.image_token_id] * count + [end]


def _padded_logprobs(model, trajs, image_token_id, pad_id):
    """The trainer's view: ``token_logprobs`` of the trajectories on one right-padded batch with pixels."""
    width = max(len(t.token_ids) for t in trajs)
    ids = torch.full((len(trajs), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for b, t in enumerate(trajs):
        ids[b, : len(t.token_ids)] = torch.tensor(t.token_ids)
        attn[b, : len(t.token_ids)] = 1
    batch = {"input_ids": ids, "attention_mask": attn, **vision_batch(ids, [t.vision for t in trajs], image_token_id)}
    with torch.no_grad():
        return token_logprobs(model, batch)


def test_feedback_image_tokens_pixels_and_engine_logprobs(vlm, monkeypatch):
    engine, proc = vlm
    calls = _recorder(monkeypatch)
    trajs = _run(engine, proc, [_request(proc, 0), _request(proc, 1, "Which colour is the shape in it?")])
    assert [t.drop_reason for t in trajs] == [None, None], [t.error for t in trajs]
    expected_feedback = proc.encode("Look: ", add_special_tokens=False) + _image_tokens(proc, 2) + proc.encode(
        " now?", add_special_tokens=False)
    joint = proc.image_processor(images=[PROMPT_IMAGE, FEEDBACK_IMAGE], return_tensors="pt")
    for t in trajs:
        assert len(t.action_ranges) == 2 and not t.truncated
        (s1, e1), (s2, e2) = t.action_ranges
        assert t.token_ids[e1:s2] == expected_feedback  # right after the first action, image where <image> was
        mask = t.action_mask()
        assert all(m == 0 for m in mask[e1:s2]) and sum(mask) == (e1 - s1) + (e2 - s2)
        assert sum(tok == proc.image_token_id for tok in t.token_ids) == 4 + 2
        assert t.vision.image_grid_thw.tolist() == [[1, 4, 4], [1, 4, 2]]
        assert torch.equal(t.vision.pixel_values, joint["pixel_values"])
        assert torch.equal(t.vision.image_grid_thw, joint["image_grid_thw"])
        assert t.vision.images is not None and len(t.vision.images) == 2
        assert t.extra["agent_env_images"] == 1.0 and t.extra["agent_images_dropped"] == 0.0
        assert t.extra["agent_env_tokens"] == float(len(expected_feedback))
        # the second turn's engine call: the whole sequence so far and both images
        second = [c for c in calls if c[0] == t.token_ids[:s2]]
        assert len(second) == 1 and second[0][2] == t.token_ids[s2:e2]
        assert torch.equal(second[0][1].pixel_values, joint["pixel_values"])
        first = [c for c in calls if c[0] == t.token_ids[:s1]]
        assert first and first[0][1].num_images == 1
    assert len(trajs[0].token_ids) != len(trajs[1].token_ids)  # the batch below is padded
    # the engine saw those pixels: its log-probs are the trainer forward's on a padded batch
    lp = _padded_logprobs(engine.model, trajs, proc.image_token_id, proc.pad_token_id)
    for b, t in enumerate(trajs):
        pos = [i for s, e in t.action_ranges for i in range(s, e)]
        err = (lp[b, pos] - torch.tensor(t.rollout_logprobs)).abs().max().item()
        assert err < 1e-5, err
    # and they depend on the feedback image: other pixels give other log-probs for the second action
    other_pixels = proc.image_processor(images=[OTHER_IMAGE], return_tensors="pt")["pixel_values"]
    other = [replace(t, vision=VisionInput(torch.cat([t.vision.pixel_values[:16], other_pixels]),
                                           t.vision.image_grid_thw, None, 2)) for t in trajs]
    lp_other = _padded_logprobs(engine.model, other, proc.image_token_id, proc.pad_token_id)
    s2, e2 = trajs[0].action_ranges[1]
    assert (lp_other[0, s2:e2] - lp[0, s2:e2]).abs().max().item() > 1e-4


def _episode(proc, engine, budget: int) -> Episode:
    ctx = EpisodeContext(BatchingEngine(engine), proc, AgentSettings())
    return Episode(ctx, _request(proc), SamplingParams(max_new_tokens=budget))


def test_image_over_the_budget_is_dropped_with_its_tokens(vlm):
    engine, proc = vlm
    text_a, text_b = proc.encode("ab", add_special_tokens=False), proc.encode("cd", add_special_tokens=False)
    img = _image_tokens(proc, 2)  # 2 + 2 tokens
    # budget = "ab" + 3: the image (4 tokens) does not fit whole -> dropped with "cd" after it
    ep = _episode(proc, engine, len(text_a) + 3)
    prompt = list(ep.token_ids)
    assert ep.add_feedback("ab<image>cd", [FEEDBACK_IMAGE], what="step 1") == len(text_a)
    assert ep.token_ids == prompt + text_a and ep.cut and ep.remaining == 3
    traj = ep.trajectory()
    assert traj.vision.num_images == 1 and traj.truncated  # the prompt's image only
    assert traj.extra["agent_images_dropped"] == 1.0 and traj.extra["agent_env_images"] == 0.0
    assert asyncio.run(ep.generate()) is None  # a cut feedback ends the episode
    # budget = "ab" + image + 1: the image fits, the text after it is cut to 1 token
    ep = _episode(proc, engine, len(text_a) + 4 + 1)
    assert ep.add_feedback("ab<image>cd", [FEEDBACK_IMAGE]) == len(text_a) + 5
    assert ep.token_ids == prompt + text_a + img + text_b[:1] and ep.remaining == 0
    assert ep.trajectory().vision.num_images == 2 and ep.images_dropped == 0
    # two images without placeholders: before the text; only the first fits
    ep = _episode(proc, engine, 4 + 3)
    assert ep.add_feedback("ab", [FEEDBACK_IMAGE, OTHER_IMAGE]) == 4
    assert ep.token_ids == prompt + img and ep.images_dropped == 1 and ep.env_images == 1


def test_image_values_and_placeholder_mismatch(vlm, tmp_path):
    import base64
    import io

    from rlhforge.agents import AgentError

    engine, proc = vlm
    path = tmp_path / "fb.png"
    FEEDBACK_IMAGE.save(path)
    buf = io.BytesIO()
    FEEDBACK_IMAGE.save(buf, format="PNG")
    ep = _episode(proc, engine, 100)
    n = ep.add_feedback("<image><image>", [str(path), base64.b64encode(buf.getvalue()).decode()])
    assert n == 8 and ep.vision.num_images == 3
    assert torch.equal(ep.vision.pixel_values[16:24], ep.vision.pixel_values[24:])  # same image both ways
    with pytest.raises(AgentError, match=r"step 2 environment_feedback has 2 <image> placeholders but 1 "):
        ep.add_feedback("<image> and <image>", [FEEDBACK_IMAGE], what="step 2")
    with pytest.raises(AgentError, match=r"step 3 environment_images\[0\]: image file not found: .*nope.png"):
        ep.add_feedback("x", ["nope.png"], what="step 3")
    # reset may not rewrite a prompt with images into one without their image tokens
    ep = _episode(proc, engine, 100)
    with pytest.raises(AgentError, match="the new prompt has 0 image tokens but its 1 images need 4"):
        ep.reset_prompt(proc.encode("What colour?", add_special_tokens=False))


def test_text_model_given_images_fails_naming_the_step(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = HFEngine.from_pretrained(str(tiny_model_dir), tok)
    ids = tok.encode("Describe it.", add_special_tokens=False)
    (traj,) = _run(engine, tok, [PromptRequest(ids, "x", None, 5, 0)])
    assert traj.drop_reason == "env_error"
    assert "prompt 5 sample 0" in traj.error
    assert "step 1 returned 1 environment_images but the actor is a text model" in traj.error
