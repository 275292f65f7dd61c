"""Muon (``--optim muon`` / ``--actor.optim muon``): which parameters it updates, that its step is
the Newton-Schulz-orthogonalised one (not AdamW's), that the loss falls, and that DeepSpeed ZeRO's
Muon takes the same first step as the plain-torch strategy."""

import io
import os
import socket
import sys
from pathlib import Path

import pytest
import torch

from rlhforge.backend.optim import MuonWithAdamW, build_optimizer, muon_param_groups, muon_param_split
from rlhforge.config.components import AdamConfig, MuonConfig, OptimConfig

sys.path.insert(0, str(Path(__file__).parent))
import muon_worker  # noqa: E402
from tests.torchrun import run_torchrun

WORKER = Path(__file__).with_name("muon_worker.py")
MUON = OptimConfig(name="muon", adam=AdamConfig(lr=1e-3, weight_decay=0.1), muon=MuonConfig(lr=0.02))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")


def test_parameter_split_on_tiny_llama(tiny_model_dir):
    muon, adam = muon_param_split(_model(tiny_model_dir))
    layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    assert muon == [f"model.layers.{i}.{m}.weight" for i in (0, 1) for m in layer]
    # embeddings (tied with the LM head, so listed once), every norm weight
    assert adam == ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                    "model.layers.0.post_attention_layernorm.weight", "model.layers.1.input_layernorm.weight",
                    "model.layers.1.post_attention_layernorm.weight", "model.norm.weight"]
    # heads of a critic / reward model and an untied LM head are matrices that stay on AdamW; biases too
    named = [(n, torch.nn.Parameter(torch.zeros(s))) for n, s in [
        ("value_head.weight", (1, 8)), ("score.weight", (1, 8)), ("lm_head.weight", (32, 8)),
        ("model.layers.0.self_attn.q_proj.weight", (8, 8)), ("model.layers.0.self_attn.q_proj.bias", (8,))]]
    assert muon_param_split(named) == (["model.layers.0.self_attn.q_proj.weight"],
                                       ["value_head.weight", "score.weight", "lm_head.weight",
                                        "model.layers.0.self_attn.q_proj.bias"])
    groups = muon_param_groups(named, MUON)
    assert [(g["use_muon"], g["lr"], g["weight_decay"], len(g["params"])) for g in groups] == [
        (True, 0.02, 0.1, 1), (False, 1e-3, 0.1, 3), (False, 1e-3, 0.0, 1)]  # no decay on the bias


def _newton_schulz_fp64(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Keller Jordan's quintic iteration written out again, in float64."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp_min(1e-7)
    for _ in range(steps):
        m = x @ x.T
        x = a * x + (b * m + c * m @ m) @ x
    return x.T if tall else x


def test_first_step_is_orthogonalised_for_matrices_and_adamw_for_the_rest(tiny_model_dir):
    model = _model(tiny_model_dir)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids, attn = muon_worker.fixed_batch(model.config.vocab_size)
    muon_worker.mean_nll(model, ids, attn).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model, MUON)
    assert isinstance(opt, MuonWithAdamW)
    opt.step()
    muon, adam = muon_param_split(model)
    params = dict(model.named_parameters())
    for name in muon:
        rows, cols = before[name].shape
        # step 1: momentum buffer = g, Nesterov input g + 0.95 g; decoupled decay 0.02 * 0.1; lr x sqrt(max(1, r/c))
        want = before[name] * (1 - 0.02 * 0.1) - 0.02 * max(1.0, rows / cols) ** 0.5 * _newton_schulz_fp64(
            1.95 * grads[name]).float()
        delta, want_delta = params[name].detach() - before[name], want - before[name]
        cos = torch.nn.functional.cosine_similarity(delta.flatten(), want_delta.flatten(), 0)
        # torch runs the iteration in bf16: the direction agrees to ~1.5%, the size (lr x shape factor) to 3%
        assert cos > 0.98 and abs(delta.norm() / want_delta.norm() - 1) < 0.03, (name, float(cos))
        # an orthogonalised step: its leading singular values are flattened into Newton-Schulz's ~0.5..1.5
        # band (the gradient of 44 tokens has low rank, so the tail stays small)
        sv = torch.linalg.svdvals((delta + 0.02 * 0.1 * before[name]) / (0.02 * max(1.0, rows / cols) ** 0.5))
        assert float(sv[7]) > 0.5 and float(sv[0]) < 1.5, (name, sv[:8])
    for name in adam:
        # AdamW's first step: m_hat / sqrt(v_hat) = g / |g| (bias corrections cancel); decay on embeddings only
        decay = 0.1 if "embed" in name else 0.0
        want = before[name] * (1 - 1e-3 * decay) - 1e-3 * grads[name] / (grads[name].abs() + 1e-8)
        torch.testing.assert_close(params[name].detach(), want, rtol=0, atol=1e-6, msg=name)


def test_one_step_differs_from_adamw(tiny_model_dir):
    muon = muon_worker.run(str(tiny_model_dir), "torch", "muon", 1)["params"]
    adam = muon_worker.run(str(tiny_model_dir), "torch", "adam", 1)["params"]
    init = _model(tiny_model_dir).state_dict()
    name = "model.layers.0.mlp.down_proj.weight"
    du, da = muon[name] - init[name], adam[name] - init[name]
    assert torch.nn.functional.cosine_similarity(du.flatten(), da.flatten(), 0) < 0.9
    # AdamW's first step moves every entry by ~lr (1e-3); Muon's spreads a spectral-norm-O(lr) step
    assert (da.abs().mean() - 1e-3).abs() < 1e-4 and (du.abs().mean() - 1e-3).abs() > 2e-4
    torch.testing.assert_close(muon["model.norm.weight"], adam["model.norm.weight"])  # both AdamW there


def test_loss_falls_over_ten_steps_on_a_fixed_batch(tiny_model_dir):
    losses = muon_worker.run(str(tiny_model_dir), "torch", "muon", 10)["losses"]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 2.0, losses  # 6.92 -> 3.80 on this batch


def test_state_dict_round_trip_continues_the_same_steps(tiny_model_dir):
    def step(model, opt):
        ids, attn = muon_worker.fixed_batch(model.config.vocab_size, seed=1)
        muon_worker.mean_nll(model, ids, attn).backward()
        opt.step()
        opt.zero_grad()

    a = _model(tiny_model_dir)
    opt_a = build_optimizer(a, MUON)
    step(a, opt_a)
    b = _model(tiny_model_dir)
    b.load_state_dict(a.state_dict())
    opt_b = build_optimizer(b, MUON)
    buf = io.BytesIO()
    torch.save(opt_a.state_dict(), buf)  # as a resume checkpoint does (an in-memory dict would share tensors)
    buf.seek(0)
    opt_b.load_state_dict(torch.load(buf, weights_only=False))  # momentum buffers and Adam moments travel
    step(a, opt_a), step(b, opt_b)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=name)


def _worker(model_dir, out, nproc, *specs):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1",  # eager muon_update: no inductor build
           "PYTHONPATH": str(Path(__file__).parents[2])}
    cmd = [sys.executable, str(WORKER), str(model_dir), str(out), "muon", "1", *specs]
    if nproc > 1:
        cmd[1:1] = ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
                    str(_free_port())]
    proc = run_torchrun(cmd, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(out, weights_only=False)


@pytest.mark.slow
def test_deepspeed_zero_and_fsdp2_take_the_torch_strategy_step(tiny_model_dir, tmp_path):
    """DeepSpeed's MuonWithAuxAdam under ZeRO-2 and ZeRO-3, on 1 and 2 CPU ranks (each rank on the same batch,
    so the averaged gradient is one rank's; DeepSpeed's Muon gathers the sharded matrices), lands on one
    recomputation of the step outside ZeRO: DeepSpeed's own ``muon_update`` on the plain-torch gradient.
    Its Newton-Schulz runs in fp16 ("gram"), which turns a last-bit difference in the gradient (ZeRO-2 and
    ZeRO-3 sum it in different orders) into ~1e-3 of the update, so the stages agree with it in direction
    and size (cosine > 0.999, norm within 0.5%), not bit for bit; since DeepSpeed 0.19.8 they also differ
    from each other by that much (0.19.7 fed both the same bits). The AdamW parameters match to 1e-6.
    torch's Muon runs in bf16: it agrees in direction and size only. FSDP2's DTensor shards go through
    torch.optim.Muon: one rank's direction and size (per-shard Newton-Schulz would change both)."""
    ds = _worker(tiny_model_dir, tmp_path / "ds.pt", 1, "deepspeed:2", "deepspeed:3", "deepspeed_reference")
    two = _worker(tiny_model_dir, tmp_path / "two.pt", 2, "deepspeed:2", "deepspeed:3", "fsdp2")
    ref = muon_worker.run(str(tiny_model_dir), "torch", "muon", 1)
    init = _model(tiny_model_dir).state_dict()
    muon, adam = muon_param_split(_model(tiny_model_dir))
    z2, recomputed = ds["deepspeed:2"]["params"], ds["deepspeed_reference"]["params"]
    for other in (ds["deepspeed:2"], ds["deepspeed:3"], two["deepspeed:2"], two["deepspeed:3"]):
        for name in muon:  # DeepSpeed's Muon step, whatever the stage and the number of ranks
            d, d_r = (other["params"][name] - init[name]).flatten(), (recomputed[name] - init[name]).flatten()
            assert torch.nn.functional.cosine_similarity(d, d_r, 0) > 0.999, name
            assert abs(d.norm() / d_r.norm() - 1) < 0.005, name
        for name in adam:
            torch.testing.assert_close(other["params"][name], z2[name], rtol=0, atol=1e-6, msg=name)
    for params, tol in ((z2, 0.05), (two["fsdp2"]["params"], 0.02)):
        for name in muon:
            d, d_t = (params[name] - init[name]).flatten(), (ref["params"][name] - init[name]).flatten()
            assert torch.nn.functional.cosine_similarity(d, d_t, 0) > 0.97, name
            assert abs(d.norm() / d_t.norm() - 1) < tol, name
    for name in adam:
        torch.testing.assert_close(z2[name], ref["params"][name], rtol=0, atol=1e-6, msg=name)
    assert ds["deepspeed:2"]["losses"][1] == pytest.approx(ref["losses"][1], abs=1e-3)


def test_start_up_notices(capsys):
    """--optim muon + --max_norm > 0: one line recommending 0; DeepSpeed's Muon fixes ns_steps / nesterov."""
    from rlhforge.config.parsing import parse_args
    from rlhforge.config.rl import RLConfig
    from rlhforge.config.sft import SFTConfig

    base = ["--model.model_name_or_path", "/nonexistent", "--data.dataset", "builtin:arithmetic", "--optim", "muon"]
    cases = [([], ["--optim.max_norm 0 is recommended"]), (["--max_norm", "0"], []),
             (["--max_norm", "0", "--ds.strategy", "deepspeed", "--muon.ns_steps", "3", "--muon.no_nesterov"],
              ["--optim.muon.ns_steps 3 has no effect under DeepSpeed", "--optim.muon.nesterov False has no effect"]),
             (["--max_norm", "0", "--muon.ns_steps", "3"], [])]  # plain torch honours ns_steps
    for extra, want in cases:
        capsys.readouterr()
        parse_args(SFTConfig, base + extra)  # parses and validates
        lines = [x for x in capsys.readouterr().err.splitlines() if "muon" in x.lower()]
        assert len(lines) == len(want) and all(w in x for w, x in zip(want, lines)), (extra, lines)
    rl = ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "builtin:arithmetic", "--rollout.batch_size", "8",
          "--train.batch_size", "8", "--reward.remote_url", "builtin:arithmetic", "--actor.optim", "muon"]
    capsys.readouterr()
    parse_args(RLConfig, rl)
    lines = [x for x in capsys.readouterr().err.splitlines() if "muon" in x.lower()]
    assert len(lines) == 1 and "--actor.optim muon with --actor.max_norm 1.0" in lines[0], lines


def test_rl_actor_trains_with_muon_through_the_cli(tiny_model_dir, tmp_path):
    """One RL step, one optimizer step with --actor.optim muon (peak lr, no warm-up, no decay): the
    exported attention matrix moved by an orthogonalised step of spectral size ~ muon.lr."""
    from tests.rl.helpers import rl_args, write_reward
    from rlhforge.cli.train_ppo_ray import main as rl_main
    from safetensors.torch import load_file

    reward = write_reward(tmp_path / "reward.py")
    out = tmp_path / "run"
    assert rl_main(rl_args(tiny_model_dir, out, "--reward.remote_url", reward, "--train.batch_size", "8",
                           "--actor.optim", "muon", "--actor.muon.lr", "0.02", "--actor.max_norm", "0",
                           "--algo.kl.init_coef", "0", steps=1)) == 0
    before, after = load_file(tiny_model_dir / "model.safetensors"), load_file(out / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"  # 128 x 128: no shape factor
    sv = torch.linalg.svdvals((after[name] - before[name]) / 0.02)
    assert 0.5 < float(sv[0]) < 1.5 and float(sv[3]) > 0.3, sv[:8]
    norm = "model.norm.weight"  # AdamW (lr 1e-3): its first step moves each entry by ~lr
    assert 0.5e-3 < float((after[norm] - before[norm]).abs().max()) < 1.5e-3
