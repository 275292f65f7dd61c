"""An OpenEnv environment server for examples/rl_openenv_env.yaml (``openenv-core``'s ``create_app``):
two turns, each reply rewarded by its share of digits. Run: ``python examples/agents/openenv_digits_server.py``
(serves http://127.0.0.1:8011; its WebSocket ``/ws`` is what rlhforge and OpenEnv's ``EnvClient`` use)."""

from openenv.core.env_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class DigitAction(Action):
    message: str


class DigitObservation(Observation):
    prompt: str = ""


class DigitEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # one session per concurrent episode

    def __init__(self):
        super().__init__()
        self._state = State(episode_id="", step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._state = State(episode_id=episode_id or "", step_count=0)
        return DigitObservation(prompt="Write digits.", done=False, reward=None)

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        text = action.message.strip()
        reward = sum(c.isdigit() for c in text) / max(len(text), 1)
        done = self._state.step_count >= 2
        return DigitObservation(prompt="" if done else "More digits.", done=done, reward=reward)

    @property
    def state(self):
        return self._state


app = create_app(DigitEnv, DigitAction, DigitObservation, max_concurrent_envs=64)

if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=8011)
