"""Multi-node on one machine (docs/distributed.md, "Several nodes on one machine"): a Ray cluster of
two nodes on 127.0.0.1, the driver joining through ``RAY_ADDRESS``.

- the actor's two ranks land on different nodes (the gloo process group spans both) and the run
  trains as usual;
- the second node is lost mid-run (its raylet and workers killed at once, between two steps): the run
  stops in bounded time with exit 4 and a message naming the actor rank that died; after a node
  joins again, ``--ckpt.load_enable`` continues the uninterrupted run's curve exactly;
- three nodes: the vLLM engine actor on a node of its own, the weight-sync group across nodes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.rl.helpers import per_step, rl_args

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).parents[2]

# the driver's reward function; with BLOCK_AT set, its call number BLOCK_AT waits (between two steps,
# the actor ranks idle) until the test has killed the second node
REWARD = '''
import os, time
from pathlib import Path

def reward_func(queries, prompts, labels, **kwargs):
    calls = Path(os.environ["COUNT_FILE"])
    n = int(calls.read_text()) + 1 if calls.exists() else 1
    calls.write_text(str(n))
    if os.environ.get("BLOCK_AT") == str(n):
        Path(os.environ["READY_FILE"]).write_text("1")
        deadline = time.time() + 120
        while not Path(os.environ["GO_FILE"]).exists() and time.time() < deadline:
            time.sleep(0.1)
    rewards = [(len(r) % 3) / 2.0 for r in kwargs["responses"]]
    return {"rewards": rewards, "scores": rewards}
'''


@pytest.fixture()
def cluster(ray_module, request):
    nodes = getattr(request, "param", 2)
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("two_node_cluster.py")), str(nodes)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})

    def command(cmd: str, expect: str) -> None:
        proc.stdin.write(cmd + "\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == expect

    line = proc.stdout.readline().split()
    assert line[:1] == ["ADDRESS"], line
    try:
        yield line[1], command
    finally:
        try:
            proc.stdin.write("quit\n")
            proc.stdin.flush()
            proc.wait(timeout=60)
        except Exception:  # noqa: BLE001
            proc.kill()


def _run(address, out, tmp_path, *extra, env_extra=None, background=False, steps=4):
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    args = rl_args(ROOT / "unused", out, "--reward.remote_url", reward, "--train.workers", "ray",
                   "--actor.num_gpus_per_node", "2", "--ckpt.save_steps", "1", "--ckpt.max_num", "5",
                   "--deadline.collective_s", "30", "--deadline.worker_call_s", "90", "--algo.kl.init_coef", "0",
                   *extra, steps=steps)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RAY_ADDRESS": address,
           "COUNT_FILE": str(out) + ".count", **(env_extra or {})}
    cmd = [sys.executable, "-m", "rlhforge.cli.train_ppo_ray", *args]
    if background:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def test_two_nodes_on_loopback_node_loss_and_resume(cluster, tiny_model_dir, tmp_path):
    address, command = cluster
    model = ["--actor.model_name_or_path", str(tiny_model_dir)]
    straight = tmp_path / "straight"
    proc = _run(address, straight, tmp_path, *model)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Connected to Ray cluster" in proc.stderr + proc.stdout  # joined through RAY_ADDRESS, not a new one
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("[rlhforge] ray placement")]
    assert line.startswith("[rlhforge] ray placement over 2 node(s)"), line  # one actor rank on each node
    assert sorted(per_step(straight, "actor/policy_loss")) == [1, 2, 3, 4]

    # the second node dies between steps 2 and 3 (during step 3's reward call)
    lost = tmp_path / "lost"
    ready, go = tmp_path / "ready", tmp_path / "go"
    run = _run(address, lost, tmp_path, *model, background=True,
               env_extra={"BLOCK_AT": "3", "READY_FILE": str(ready), "GO_FILE": str(go)})
    deadline = time.time() + 300
    while not ready.exists():
        assert run.poll() is None and time.time() < deadline, run.stderr.read()[-3000:] if run.poll() else "timeout"
        time.sleep(0.2)
    command("kill", "KILLED")
    t0 = time.time()
    go.write_text("1")
    stdout, stderr = run.communicate(timeout=300)
    stopped_s = time.time() - t0
    assert run.returncode == 4, stderr[-3000:]
    assert "error: actor worker rank" in stderr and "died" in stderr.lower(), stderr[-2000:]
    assert stopped_s < 120, stopped_s  # bounded: well inside --deadline.worker_call_s
    assert sorted(per_step(lost, "actor/policy_loss")) == [1, 2]
    assert (lost / "ckpts" / "step_2").is_dir() and not (lost / "ckpts" / "step_3").exists()

    # a node joins again; the resumed run continues the uninterrupted curve
    command("add", "ADDED")
    proc = _run(address, lost, tmp_path, *model, "--ckpt.load_enable")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming from {lost / 'ckpts' / 'step_2'}: steps 1-2 of 4 are done" in proc.stdout
    for key in ("rollout/reward_mean", "actor/policy_loss", "actor/grad_norm"):
        a, b = per_step(straight, key), per_step(lost, key)
        assert sorted(b) == [1, 2, 3, 4], key
        for step in (3, 4):
            assert b[step] == pytest.approx(a[step], abs=1e-6), (key, step)


@pytest.mark.usefixtures("vllm")
@pytest.mark.parametrize("cluster", [3], indirect=True)
def test_engine_actor_on_another_node_synced_across_nodes(cluster, tiny_model_dir, tmp_path):
    """Three one-CPU nodes: the actor's two ranks take two of them, the vLLM engine actor the third, so
    the weight-sync group (actor rank 0 -> engine, gloo) spans two nodes; every sync is verified."""
    address, _ = cluster
    out = tmp_path / "engines"
    proc = _run(address, out, tmp_path, "--actor.model_name_or_path", str(tiny_model_dir), "--vllm.num_engines", "1",
                steps=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (actors,) = [x for x in proc.stdout.splitlines() if x.startswith("[rlhforge] ray placement")]
    (engines,) = [x for x in proc.stdout.splitlines() if x.startswith("[rlhforge] engine placement")]
    actor_nodes = {part.split(":")[0].split()[-1] for part in actors.split(": ", 1)[1].split("; ")}
    engine_node = engines.rsplit("on node ", 1)[1]
    assert len(actor_nodes) == 2 and engine_node not in actor_nodes, (actors, engines)
    assert sorted(per_step(out, "actor/policy_loss")) == [1, 2]
    # the engine generated step 2 with the synced weights: its log-probs are the trainer's
    gap = per_step(out, "rollout/logprob_diff_rollout_vs_train")
    print("rollout-vs-train log-prob gap per step:", gap)
    assert gap[2] < 1e-5, gap  # measured 2.2e-7
