"""The post-sync effect check through the real CLI (docs/rl.md, "Weights in effect after every sync"): after
every weight sync the engines score a fixed probe and their log-probs are compared with the actor's.
A run logs ``sync/probe_logprob_diff`` every step, below the bound; a sync that does not take effect on
vLLM's CPU build (faults injected from here: tests/rl/sync_probe_faults.py) stops the run, naming the engine
and the sync, although the fingerprints match."""

import pytest

from tests.rl.helpers import metrics, rl_args, write_reward

PROBE_KEYS = ("sync/probe_logprob_diff", "sync/probe_logprob_diff_max", "sync/probe_policy_change",
              "timing/sync_probe")


def _run(tiny_model_dir, tmp_path, *extra, steps=2):
    from rlhforge.cli.train_ppo_ray import main as rl_main

    reward = write_reward(tmp_path / "reward.py")  # varied rewards: the actor's weights change every step
    return rl_main(rl_args(tiny_model_dir, tmp_path / "run", "--reward.remote_url", reward, *extra, steps=steps))


def _probe_rows(run_dir):
    return [r for r in metrics(run_dir) if "timing/broadcast" in r]


def test_an_hf_engine_run_logs_the_probe_every_step(tiny_model_dir, tmp_path):
    # an engine with its own copy of the weights (by default a one-process fp32 run's engine shares the
    # actor's module, and has nothing to sync: tests/rl/test_shared_engine.py)
    assert _run(tiny_model_dir, tmp_path, "--rollout.hf_engine_weights", "copy", steps=3) == 0
    rows = _probe_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert all(k in r for k in PROBE_KEYS), r
        assert r["sync/probe_logprob_diff"] < 1e-5  # the engine holds the actor's own fp32 weights
        assert r["sync/probe_policy_change"] > 1e-2  # ... which moved: a stale engine would be seen at 1e-3
        assert 0 < r["timing/sync_probe"] < 5


@pytest.mark.usefixtures("vllm")
@pytest.mark.timeout(600)
class TestVLLM:
    def test_a_run_with_one_vllm_engine_logs_the_probe_every_step_below_the_bound(self, tiny_model_dir, tmp_path):
        assert _run(tiny_model_dir, tmp_path, "--vllm.num_engines", "1", steps=3) == 0
        rows = _probe_rows(tmp_path / "run")
        assert [r["step"] for r in rows] == [1, 2, 3]
        for r in rows:
            assert all(k in r for k in PROBE_KEYS), r
            assert r["sync/probe_logprob_diff"] < 1e-4  # fp32 vLLM CPU vs fp32 torch (the bound is 1e-3)
            assert r["sync/probe_logprob_diff_max"] < 1e-3
            assert r["sync/probe_policy_change"] > 1e-2

    @pytest.mark.parametrize("fault", ["SkippedRepackExtension", "PutBackExtension"])
    def test_a_sync_that_does_not_take_effect_stops_the_run(self, tiny_model_dir, tmp_path, fault):
        """The CLI in a subprocess (vLLM adds a worker extension to its worker class for the whole process), with
        the engine's worker extension swapped for a faulty one (tests/rl/sync_probe_faults.py)."""
        import subprocess
        import sys
        from pathlib import Path

        args = rl_args(tiny_model_dir, tmp_path / "run", "--reward.remote_url", write_reward(tmp_path / "reward.py"),
                       "--vllm.num_engines", "1", steps=3)
        code = ("import sys, torch; torch.set_num_threads(1)\n"
                "import rlhforge.rollout.vllm_engine as vllm_engine\n"
                f"vllm_engine.EXTENSION_CLS = 'tests.rl.sync_probe_faults.{fault}'\n"
                "from rlhforge.cli.train_ppo_ray import main\n"
                "sys.exit(main(sys.argv[1:]))\n")
        root = Path(__file__).resolve().parents[2]
        proc = subprocess.run([sys.executable, "-c", code, *args], cwd=root, capture_output=True, text=True,
                              timeout=540, env={**__import__("os").environ, "PYTHONPATH": str(root)})
        assert proc.returncode == 4, proc.stderr[-3000:]  # the exit status of every weight-sync fault
        err = proc.stderr
        # the sync at the start of the run loads the weights the engine started with: it passes; the first
        # sync of trained weights (after step 1) does not take effect
        assert ("error: weight sync to version 1 did not take effect: vLLM engine's log-probs on the probe differ "
                "from the trainer's by") in err, err[-3000:]
        assert "above --train.sync_probe_bound 0.001" in err
        assert "did not reach the engines" not in err  # the fingerprints matched
        run = tmp_path / "run"  # it stopped within step 1: no step was logged
        assert not (run / "metrics.jsonl").exists() or _probe_rows(run) == []
