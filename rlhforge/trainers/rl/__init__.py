"""The RL trainer (``rlhforge rl``): one loop (:mod:`.loop`) and the pieces it reads top to bottom.

- :mod:`.loop`: :class:`RLTrainer` (rollouts -> experience -> updates -> weight sync -> eval/checkpoint);
- :mod:`.experience`: rollouts in, the training batch out (rewards, log-probs, values, advantages);
- :mod:`.rollouts`: synchronous and asynchronous (one step ahead) rollout producers;
- :mod:`.prompts`: the prompt list, the resumable prompt stream, oversampling;
- :mod:`.metrics`: evaluation, version lag, the token check;
- :mod:`.checkpoints`: the run's state, saving and resuming.
"""

from rlhforge.trainers.rl.loop import RLState, RLTrainer, request_seed

__all__ = ["RLTrainer", "RLState", "request_seed"]
