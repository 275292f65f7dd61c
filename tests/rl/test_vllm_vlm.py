"""The vLLM engine and vision-language models (``generate(..., vision=[VisionInput | None])``).

vLLM 0.32's Qwen2-VL support needs torchvision, which vLLM's CPU build runs without
(rlhforge/rollout/vllm_vision.py says exactly what fails), so on CPU the engine refuses a VLM at
construction; the tests marked ``gpu`` check the image path itself against the HF engine and the
trainer's forward (skipped without CUDA: not run in CPU CI). The prompt conversion the image path
relies on, the placeholder ban as vLLM tokenizes it, and the router's hand-out of images per
request run here.
"""

import asyncio
import math

import pytest
import torch

from rlhforge.data.images import VisionInput, expand_image_tokens, vision_batch, vision_input
from rlhforge.rollout.engine import SamplingParams
from rlhforge.rollout.hf_engine import HFEngine
from rlhforge.rollout.vllm_vision import check_expanded_prompt, collapse_image_tokens, vlm_unsupported_reason
from tests.vlm_helpers import shape_image

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from rlhforge.models.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "qwen2_vl", arch="qwen2_vl", seed=0)


@pytest.fixture(scope="module")
def proc(vlm_dir):
    from rlhforge.models.vlm import load_processor

    return load_processor(str(vlm_dir))


def _prompt(proc, content, images):
    """Chat-template ids with each image's token expanded to its count, and the VisionInput (or None)."""
    ids = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False)
    if not images:
        return ids, None
    vision, counts = vision_input(proc.image_processor, images)
    ids, _ = expand_image_tokens(ids, [0] * len(ids), proc.image_token_id, counts)
    return ids, vision


CONTENTS = [
    [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}],
    "hello world",
    [{"type": "text", "text": "Two shapes:"}, {"type": "image"}, {"type": "text", "text": " and "}, {"type": "image"}],
]


def _requests(proc):
    """One image (56x56: 4 tokens), text only, two images (28x28: 1 token, 28 wide x 84 high: 3 tokens)."""
    images = [[shape_image("red", size=(56, 56))], [],
              [shape_image("blue", size=(28, 28), seed=1), shape_image("green", "circle", size=(28, 84), seed=2)]]
    return [_prompt(proc, c, im) for c, im in zip(CONTENTS, images)]


# -- what runs on CPU --------------------------------------------------------------------------------
def test_expanded_image_runs_collapse_to_one_token_each(proc):
    pad = proc.image_token_id
    reqs = _requests(proc)
    (one, v1), (text, _), (two, v2) = reqs
    assert v1.image_grid_thw.tolist() == [[1, 4, 4]] and v2.image_grid_thw.tolist() == [[1, 2, 2], [1, 6, 2]]
    assert one.count(pad) == 4 and two.count(pad) == 1 + 3
    short = collapse_image_tokens(one, v1, pad)
    assert short.count(pad) == 1 and len(short) == len(one) - 3
    # the collapsed prompt is exactly the chat template's rendering (one pad per image), which vLLM expands
    for (ids, v), content in zip([reqs[0], reqs[2]], [CONTENTS[0], CONTENTS[2]]):
        rendered = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        assert collapse_image_tokens(ids, v, pad) == rendered
    # hand-worked: grids 1x2x2 and 1x6x2 (merge 2) -> runs of 1 and 3 tokens
    v = VisionInput(torch.zeros(16, 1), torch.tensor([[1, 2, 2], [1, 6, 2]]))
    assert collapse_image_tokens([7, pad, 8, pad, pad, pad, 9], v, pad) == [7, pad, 8, pad, 9]
    with pytest.raises(ValueError, match="request 2: image 1 needs 3 consecutive image tokens at position 3"):
        collapse_image_tokens([7, pad, 8, pad, pad, 9], v, pad, "request 2")
    with pytest.raises(ValueError, match="2 image\\(s\\) but image tokens for 1"):
        collapse_image_tokens([7, pad, 8], v, pad)
    with pytest.raises(ValueError, match="more image tokens than its 2 image"):
        collapse_image_tokens([pad, pad, pad, pad, pad], v, pad)
    assert collapse_image_tokens(text, VisionInput(torch.zeros(0, 1), torch.zeros(0, 3, dtype=torch.long)),
                                 pad) == text
    check_expanded_prompt(one, list(one))
    with pytest.raises(RuntimeError, match="min_pixels / max_pixels"):
        check_expanded_prompt(one, one + [pad])


def test_the_placeholder_ban_is_exactly_the_image_and_video_tokens_as_vllm_tokenizes_it(vllm, proc, vlm_dir):
    """The engine bans its placeholders as ``bad_words`` (strings); vLLM's own conversion must give back
    exactly those single tokens, nothing else."""
    from rlhforge.rollout.vllm_vision import vlm_placeholders

    image, banned = vlm_placeholders(str(vlm_dir))
    assert image == proc.image_token_id and sorted(banned) == sorted(proc.placeholder_token_ids)
    words = proc.tokenizer.convert_ids_to_tokens(banned)
    assert words == ["<|image_pad|>", "<|video_pad|>"]
    from vllm.tokenizers.registry import get_tokenizer  # the tokenizer vLLM's engine loads from the folder

    sp = vllm.SamplingParams(max_tokens=4, bad_words=words)
    sp.update_from_tokenizer(get_tokenizer(str(vlm_dir)))
    assert sp._bad_words_token_ids == [[t] for t in banned]


def test_a_vlm_is_refused_at_construction_on_a_vllm_without_torchvision(vllm, vlm_dir, tiny_model_dir, request):
    from rlhforge.rollout.vllm_engine import VLLMEngine
    from rlhforge.rollout.vllm_vision import vlm_placeholders

    assert vlm_placeholders(str(tiny_model_dir)) is None  # text models are not refused (tests/rl/test_vllm_engine.py)
    if vlm_unsupported_reason() is None:  # torchvision works (vLLM on a GPU): the engine is built, with its ban
        engine = request.getfixturevalue("gpu_engine")
        assert engine.vision == vlm_placeholders(str(vlm_dir))
        assert engine._banned_words == ["<|image_pad|>", "<|video_pad|>"]
        return
    # the cause is real: vLLM's Qwen2-VL module itself cannot be imported without torchvision
    with pytest.raises(Exception, match="torchvision"):
        import vllm.model_executor.models.qwen2_vl  # noqa: F401
    with pytest.raises(ValueError, match=r"is a vision-language model, which this vLLM cannot serve: vLLM 0\.32's "
                                         r"Qwen2-VL model .* torchvision .*--vllm\.num_engines 0"):
        VLLMEngine(str(vlm_dir), max_model_len=256)


def test_a_text_engine_refuses_images_and_takes_image_free_entries(vllm, tiny_model_dir, proc):
    from transformers import AutoTokenizer

    from rlhforge.rollout.vllm_engine import VLLMEngine

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = VLLMEngine.from_tokenizer(str(tiny_model_dir), tok, max_model_len=64)
    try:
        assert engine.vision is None and engine._banned_words is None
        prompts = [tok("hello world")["input_ids"], tok("sort 3 1 2")["input_ids"]]
        greedy = [SamplingParams(max_new_tokens=5, temperature=0.0)] * 2
        plain = asyncio.run(engine.generate(prompts, greedy))
        same = asyncio.run(engine.generate(prompts, greedy, vision=[None, None]))
        assert [o.token_ids for o in same] == [o.token_ids for o in plain] and len(plain[0].token_ids) == 5
        _, v = _requests(proc)[0]
        with pytest.raises(ValueError, match="not a vision-language model: it cannot take images"):
            asyncio.run(engine.generate(prompts, greedy, vision=[v, None]))
        with pytest.raises(ValueError, match="2 prompts but 1 image entries"):
            asyncio.run(engine.generate(prompts, greedy, vision=[v]))
    finally:
        engine.close()


def test_router_hands_each_engine_its_requests_images(vlm_dir, proc):
    """EngineRouter (several vLLM engines in one process) slices ``vision`` with the prompts: checked with
    two HF engines, whose outputs must equal one engine's on the whole batch."""
    from transformers import AutoModelForImageTextToText

    from rlhforge.rollout.vllm_engine import EngineRouter

    model = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32)
    reqs = _requests(proc)
    prompts, visions = [r[0] for r in reqs], [r[1] for r in reqs]
    greedy = [SamplingParams(max_new_tokens=6, temperature=0.0)] * len(prompts)
    one = HFEngine.from_model(model, proc).generate_sync(prompts, greedy, visions)
    router = EngineRouter([HFEngine.from_model(model, proc), HFEngine.from_model(model, proc)])
    assert sorted(set(router.assign(prompts, greedy))) == [0, 1]  # both engines get requests
    routed = asyncio.run(router.generate(prompts, greedy, vision=visions))
    assert [o.token_ids for o in routed] == [o.token_ids for o in one]
    for a, b in zip(routed, one):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)
    with pytest.raises(ValueError, match="3 prompts but 2 image entries"):
        asyncio.run(router.generate(prompts, greedy, vision=visions[:2]))


# -- the image path itself: vLLM on a GPU (not run in CPU CI) ----------------------------------------
def _trainer_logprobs(model, proc, prompt, vision, response, temperature):
    """The trainer's forward (collate_padded + vision_batch) over prompt + response: log p(t) of each response
    token, and log(1 - p(placeholders)) at each response position (what vLLM's masking renormalises by)."""
    from rlhforge.data.packing import collate_padded
    from rlhforge.models.forward import token_logprobs

    ids = prompt + response
    batch = collate_padded([{"input_ids": ids, "loss_mask": [0] * len(prompt) + [1] * len(response)}],
                           proc.pad_token_id)
    batch.update(vision_batch(batch["input_ids"], [vision], proc.image_token_id))
    with torch.no_grad():
        lp, logits = token_logprobs(model, batch, temperature, return_logits=True)
    probs = torch.softmax(logits[0, len(prompt) - 1: len(ids) - 1].float() / temperature, -1)
    rest = torch.log1p(-probs[:, proc.placeholder_token_ids].sum(-1))
    return lp[0, len(prompt):].tolist(), rest.tolist()


@pytest.fixture(scope="module")
def gpu_engine(vllm, vlm_dir):
    from rlhforge.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(str(vlm_dir), max_model_len=256, gpu_memory_utilization=0.3, enforce_eager=True)
    yield engine
    engine.close()


@pytest.mark.gpu
def test_vllm_greedy_and_logprobs_with_images_equal_the_hf_engine_and_the_trainer(gpu_engine, vlm_dir, proc):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    reqs = _requests(proc)
    prompts, visions = [r[0] for r in reqs], [r[1] for r in reqs]
    greedy = [SamplingParams(max_new_tokens=8, temperature=0.0)] * len(prompts)
    ours = asyncio.run(gpu_engine.generate(prompts, greedy, vision=visions))
    hf = HFEngine.from_model(model, proc).generate_sync(prompts, greedy, visions)
    assert [o.token_ids for o in ours] == [o.token_ids for o in hf]
    banned = set(proc.placeholder_token_ids)
    for temperature in (1.0, 0.7):
        params = [SamplingParams(max_new_tokens=8, temperature=temperature, seed=s) for s in (1, 2, 3)]
        outs = asyncio.run(gpu_engine.generate(prompts, params, vision=visions))
        for p, v, o in zip(prompts, visions, outs):
            assert len(o.token_ids) == len(o.logprobs) > 0 and not banned & set(o.token_ids)
            lp, rest = _trainer_logprobs(model, proc, p, v, o.token_ids, temperature)
            # vLLM masks the placeholders before its log-probs: log p(t) - log(1 - p(placeholders))
            assert o.logprobs == pytest.approx([a - b for a, b in zip(lp, rest)], abs=1e-4)
            assert all(math.isfinite(x) for x in o.logprobs)


@pytest.mark.gpu
def test_vllm_follows_a_weight_sync_of_the_vlm(gpu_engine, vlm_dir, proc):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    reqs = _requests(proc)
    prompts, visions = [r[0] for r in reqs], [r[1] for r in reqs]
    greedy = [SamplingParams(max_new_tokens=8, temperature=0.0)] * len(prompts)
    before = [o.token_ids for o in asyncio.run(gpu_engine.generate(prompts, greedy, vision=visions))]
    # perturb the tower and the language model (HF names: model.visual.*, model.language_model.*, lm_head.*);
    # with this seed and scale the greedy tokens change and the two-image prompt's depend on its images
    # (measured with the HF engine on CPU)
    torch.manual_seed(0)
    state = {k: v + 3.0 * torch.randn_like(v) * v.std() if v.dim() == 2 and v.numel() > 1 else v
             for k, v in model.state_dict().items()}
    assert {k.split(".")[1] for k in state if k.startswith("model.")} == {"visual", "language_model"}
    model.load_state_dict(state)
    hf = HFEngine.from_model(model, proc)
    rotated = [None if v is None else vision_input(proc.image_processor, [im.rotate(90) for im in v.images])[0]
               for v in visions]
    expected = [[o.token_ids for o in hf.generate_sync(prompts, greedy, vs)] for vs in (visions, rotated)]
    assert expected[0] != before and expected[0][2] != expected[1][2]
    gpu_engine.update_weights(state)
    for vs, want in zip((visions, rotated), expected):
        assert [o.token_ids for o in asyncio.run(gpu_engine.generate(prompts, greedy, vision=vs))] == want
    params = [SamplingParams(max_new_tokens=8, temperature=1.0, seed=s) for s in (1, 2, 3)]
    for p, v, o in zip(prompts, visions, asyncio.run(gpu_engine.generate(prompts, params, vision=visions))):
        lp, rest = _trainer_logprobs(model, proc, p, v, o.token_ids, 1.0)
        assert o.logprobs == pytest.approx([a - b for a, b in zip(lp, rest)], abs=1e-4)
    original = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32).state_dict()
    gpu_engine.update_weights(original)  # the engine fixture is shared
    assert [o.token_ids for o in asyncio.run(gpu_engine.generate(prompts, greedy, vision=visions))] == before
