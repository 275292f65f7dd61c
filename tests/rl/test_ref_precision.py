"""The reference model computes exactly like the actor (its dtype mechanism under each strategy), so
KL to the reference is exactly 0 before the first update; ``--ref.offload`` moves it between uses."""

import pytest
import torch

from rlhforge.cli.train_ppo_ray import build_trainer, parse_rl_args
from tests.rl.helpers import per_step, rl_args

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _bf16_args(model_dir, out, *extra):
    args = rl_args(model_dir, out, *extra, steps=1)
    args[args.index("--ds.param_dtype") + 1] = "bf16"  # the GPU default, here on CPU (autocast / DeepSpeed bf16)
    return args


@pytest.mark.parametrize("kind, backend", [("torch", ["--ref.offload"]),
                                           ("deepspeed", ["--ds.strategy", "deepspeed", "--ds.zero_stage", "3"]),
                                           ("fsdp2", ["--ds.strategy", "fsdp2"])], ids=["torch_offload", "zero3", "fsdp2"])
def test_kl_to_the_reference_is_exactly_zero_at_step_1_in_bf16(tiny_model_dir, tmp_path, kind, backend):
    out = tmp_path / "run"
    trainer = build_trainer(parse_rl_args(_bf16_args(tiny_model_dir, out, *backend)))
    try:
        trainer.fit()
    finally:
        trainer.logger.close()
    assert per_step(out, "actor/kl_ref") == {1: 0.0}
    stats = trainer.ref.local.offload_stats()
    assert (stats["dtype"], stats["kind"]) == ("bfloat16", kind)
    if backend == ["--ref.offload"]:  # one use in the step: back before it, away again after it (and at start)
        assert (stats["mode"], stats["reloads"], stats["offloads"], stats["moved_bytes"]) == ("host_copy", 1, 2, 0)


def test_a_full_precision_reference_would_not_give_zero(tiny_model_dir, tmp_path):
    """The control: the same reference without the actor's bf16 autocast differs from it (the old
    behaviour: KL was not 0 at step 0)."""
    from rlhforge.workers.experience import ExperienceSample
    from rlhforge.workers.actor import RefWorker
    from rlhforge.models.loading import load_tokenizer

    tok = load_tokenizer(str(tiny_model_dir))
    samples = [ExperienceSample(list(range(5, 5 + n)), [0] * 2 + [1] * (n - 2), 0.0, 0.0) for n in (6, 9)]
    bf16 = RefWorker(parse_rl_args(_bf16_args(tiny_model_dir, tmp_path)), tok, torch.device("cpu"))
    fp32 = RefWorker(parse_rl_args(rl_args(tiny_model_dir, tmp_path)), tok, torch.device("cpu"))
    a, b = bf16.logprobs(samples, 2, 1.0), fp32.logprobs(samples, 2, 1.0)
    assert max(float((x - y).abs().max()) for x, y in zip(a, b)) > 1e-4


def test_ref_offload_leaves_the_logprobs_unchanged(tiny_model_dir, tmp_path):
    from rlhforge.workers.experience import ExperienceSample
    from rlhforge.workers.actor import RefWorker
    from rlhforge.models.loading import load_tokenizer

    tok = load_tokenizer(str(tiny_model_dir))
    samples = [ExperienceSample(list(range(7, 7 + n)), [0] * 3 + [1] * (n - 3), 0.0, 0.0) for n in (5, 8, 11)]
    plain = RefWorker(parse_rl_args(rl_args(tiny_model_dir, tmp_path)), tok, torch.device("cpu"))
    offloaded = RefWorker(parse_rl_args(rl_args(tiny_model_dir, tmp_path, "--ref.offload")), tok, torch.device("cpu"))
    for _ in range(3):
        for x, y in zip(plain.logprobs(samples, 2, 1.0), offloaded.logprobs(samples, 2, 1.0)):
            assert torch.equal(x, y)
    assert plain.offload_stats()["mode"] == "none"
    s = offloaded.offload_stats()
    assert (s["mode"], s["reloads"], s["offloads"], s["moved_bytes"]) == ("host_copy", 3, 4, 0)  # CPU: nothing moves


@pytest.mark.gpu
def test_ref_offload_keeps_the_weights_in_host_memory_between_uses(tiny_model_dir, tmp_path):
    from rlhforge.workers.experience import ExperienceSample
    from rlhforge.workers.actor import RefWorker
    from rlhforge.models.loading import load_tokenizer

    tok = load_tokenizer(str(tiny_model_dir))
    cfg = parse_rl_args(rl_args(tiny_model_dir, tmp_path, "--ref.offload", "--train.device", "cuda"))
    ref = RefWorker(cfg, tok, torch.device("cuda", 0))
    assert all(p.device.type == "cpu" for p in ref.frozen.model.parameters())
    lp = ref.logprobs([ExperienceSample(list(range(5, 13)), [0] * 3 + [1] * 5, 0.0, 0.0)], 1, 1.0)
    assert all(p.device.type == "cpu" for p in ref.frozen.model.parameters()) and torch.isfinite(lp[0]).all()
    nbytes = sum(t.numel() * t.element_size() for t in [*ref.frozen.model.parameters(), *ref.frozen.model.buffers()])
    assert ref.offload_stats()["moved_bytes"] == 3 * nbytes  # away at start, back, away again
