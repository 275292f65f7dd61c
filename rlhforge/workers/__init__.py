"""Per-rank compute of the RL loop: what one data-parallel rank of a worker group runs (issue 45's map).

- :mod:`.actor`: :class:`ActorWorker` (the policy: log-probs, PPO-family updates, weight export) and
  :class:`RefWorker` (frozen reference log-probs); :mod:`.critic`: :class:`CriticWorker`; :mod:`.reward`: the
  reward-model group's worker; :mod:`.base`: what they share (state, export, sleep, metric reduction);
- :mod:`.experience` (the trainer's batch type), :mod:`.micro_batches` (cutting a rank's share);
- :mod:`.weight_sync`, :mod:`.ipc_sync`: the actor's side of weight sync to the generation engines.

Groups that run these workers (in this process or as Ray actors), placement and the engine actors are
:mod:`rlhforge.distributed`'s; this package never imports it.
"""
