"""Configuration of ``rlhforge rl`` / ``python -m rlhforge.cli.train_ppo_ray`` (the PPO family).

Sections and flag names follow OpenRLHF's ``train_ppo_ray`` (``--actor.*``, ``--critic.*``,
``--ref.*``, ``--reward.*``, ``--vllm.*``, ``--rollout.*``, ``--train.*``, ``--algo.*``,
``--ds.*``, ``--data.*``, ``--eval.*``, ``--ckpt.*``, ``--logger.*``). Where our default differs
from OpenRLHF's the field's docstring says so and ``docs/rl.md`` lists it. An OpenRLHF flag that has
no effect here prints one notice line, and one that cannot be honoured is refused at start-up with
the reason (``validate``), never silently.

OpenRLHF 0.9's flat names (``--pretrain``, ``--rollout_batch_size``, ``--init_kl_coef`` ...) and 0.10's
IS-correction pair are rewritten by :mod:`rlhforge.config.rl_aliases` with a one-line deprecation
notice (the ``--deadline.*`` names of older timeouts without one: :mod:`rlhforge.config.deadline`).
Validation lives in :mod:`rlhforge.config.rl_rules`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from rlhforge.config.deadline import DeadlineConfig
from rlhforge.config.env_adapter import EnvAdapterConfig
from rlhforge.config.components import (
    AdamConfig,
    CkptConfig,
    DSConfig,
    LoggerConfig,
    MuonConfig,
    OptimConfig,
)
from rlhforge.config.parsing import secret
from rlhforge.config.rl_algo import AdvantageConfig, AlgoConfig, KLConfig  # noqa: F401  (re-exported)
from rlhforge.config.rl_losses import PolicyLossParams, PolicyLossType
from rlhforge.config.rl_distill import TeacherConfig
from rlhforge.config.rl_train import RLTrainConfig  # noqa: F401  (re-exported; its own module for size)


# --------------------------------------------------------------------------------------------- models


@dataclass(frozen=True)
class _ModelOptim:
    """Optimiser block shared by actor and critic (``--actor.adam.lr``, ``--critic.max_norm`` ...)."""

    optim: Literal["adam", "muon"] = "adam"
    """Optimizer: ``adam`` (AdamW) or ``muon`` (Newton-Schulz updates for 2-D hidden weights, AdamW with
    the ``adam`` block for embeddings, heads and 1-D parameters; docs/optim.md)."""
    adam: AdamConfig = field(default_factory=AdamConfig)
    muon: MuonConfig = field(default_factory=MuonConfig)
    lr_scheduler: Literal["cosine_with_min_lr", "cosine", "constant", "constant_with_warmup", "linear"] = (
        "cosine_with_min_lr"
    )
    """Learning-rate schedule after warm-up."""
    lr_warmup_ratio: float = 0.03
    """Fraction of optimizer steps spent warming up linearly from 0."""
    min_lr_ratio: float = 0.1
    """Floor of ``cosine_with_min_lr`` as a fraction of the peak lr."""
    max_norm: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    num_nodes: int = 1
    """Nodes of this model's Ray worker group (workers = num_nodes x num_gpus_per_node)."""
    num_gpus_per_node: int = 1
    """Workers (data-parallel ranks, one device each) per node; OpenRLHF's default is 8. More than
    one worker in any group runs the models as Ray actor groups (docs/distributed.md)."""
    gradient_checkpointing_enable: bool = False
    """Recompute activations in the backward pass."""
    gradient_checkpointing_reentrant: bool = False
    """Use the re-entrant implementation of activation checkpointing."""
    trust_remote_code: bool = False
    """Allow model code shipped with the checkpoint."""

    def optim_config(self) -> OptimConfig:
        return OptimConfig(name=self.optim, adam=self.adam, muon=self.muon, lr_scheduler=self.lr_scheduler,
                           lr_warmup_ratio=self.lr_warmup_ratio, min_lr_ratio=self.min_lr_ratio, max_norm=self.max_norm)


@dataclass(frozen=True)
class ActorConfig(_ModelOptim):
    """The policy being trained."""

    model_name_or_path: str | None = None
    """HF hub id or local folder of the policy (``from_pretrained``)."""
    adam: AdamConfig = field(default_factory=lambda: AdamConfig(lr=1e-6))
    eps_clip: float = 0.2
    """PPO clip range (both sides unless ``eps_clip_low_high`` is set)."""
    eps_clip_low_high: tuple[float, float] | None = None
    """Asymmetric clip ``(low, high)``, e.g. DAPO's clip-higher ``0.2 0.28``."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 for negative advantages (None disables)."""
    policy_loss_type: PolicyLossType = "ppo"
    """Policy loss: PPO clip, GSPO / GMPO (sequence-level, seq-mean-token-mean), CISPO, SAPO, DPPO, DRO, Clip-Cov,
    KL-Cov (docs/algorithms.md; veRL's vanilla, geo_mean, dppo_tv are aliases)."""
    policy_loss: PolicyLossParams = field(default_factory=PolicyLossParams)
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """How per-token losses become one number: global token mean, or mean over sequences of the
    per-sequence token mean (OpenRLHF's two), or (rlhforge-only, the Dr. GRPO paper's normaliser) the
    per-sequence token sum divided by the constant ``rollout.max_new_tokens``, averaged over sequences.
    Counts are global over the whole optimizer step."""
    entropy_coef: float | None = None
    """Entropy bonus coefficient (None or 0: entropy is logged only)."""
    aux_loss_coef: float = 0.0
    """MoE models: weight of the router's load-balancing loss added to the actor loss, logged as
    ``actor/aux_loss`` (as OpenRLHF; 0: off; a dense model prints one notice)."""
    freeze_visual_encoder: bool = False
    """Vision-language actors: keep the vision tower frozen (docs/vlm.md); refused for a text-only model."""


@dataclass(frozen=True)
class CriticConfig(_ModelOptim):
    """Value model (only used by ``--algo.advantage.estimator gae``)."""

    model_name_or_path: str | None = None
    """Initial critic weights. Default: the reward model when one is given, else the actor."""
    adam: AdamConfig = field(default_factory=lambda: AdamConfig(lr=9e-6))
    value_clip: float | None = 0.5
    """PPO value clipping around the experience-time values (None disables)."""
    freezing_steps: int = -1
    """Critic warm-up: the actor is frozen for the first N steps (-1: never)."""
    save_value_network: bool = False
    """Also export the critic (``<ckpt.output_dir>/critic``)."""


@dataclass(frozen=True)
class RefConfig:
    """Reference policy (a frozen copy of the initial actor; created only when ``algo.kl.init_coef > 0``)."""

    num_nodes: int = 1
    """Nodes of the reference model's Ray worker group."""
    num_gpus_per_node: int = 1
    """Reference workers per node (replicas; each computes the log-probs of its shard). OpenRLHF: 8."""
    offload: bool = False
    """Keep the reference model in host memory between uses (ZeRO-3: DeepSpeed's ``offload_param``)."""


@dataclass(frozen=True)
class RewardConfig:
    """Where rewards come from, and how they are shaped."""

    model_name_or_path: str | None = None
    """Reward model(s) (HF sequence classifiers with one label, e.g. ``rlhforge rm`` output); several
    comma-separated: their rewards are summed. With Ray workers they run in a Ray group."""
    remote_url: str | None = None
    """Reward source: a ``.py`` file defining ``reward_func(queries, prompts, labels, **kw)``, an HTTP
    reward server URL (comma-separated list allowed), or a built-in verifier ``builtin:NAME``
    (``builtin:arithmetic``, ``builtin:reverse``; ``builtin:auto`` routes by the record's datasource).
    HTTP servers are probed at start-up, before any model is loaded (see ``wait_for_server_s``)."""
    api_key: str | None = secret()
    """API key of the HTTP reward servers (``rlhforge serve-rm --api_key``), sent as ``Authorization:
    Bearer KEY``. Unset: the ``RLHFORGE_REWARD_API_KEY`` environment variable, if set (prefer it: a
    flag shows in ``ps``). Never printed, logged or written to config.yaml. rlhforge-specific."""
    wait_for_server_s: float = 0.0
    """Seconds to wait at start-up for the HTTP reward servers to answer (retrying, with a progress
    line); 0 fails at once when one does not answer. rlhforge-specific."""
    timeout: float = 180.0
    """HTTP reward servers: seconds one request may take in all (connect, send, answer) before the
    attempt counts as failed (a server that accepts connections and never answers costs this much
    per attempt). OpenRLHF's client: 180 s. rlhforge-specific."""
    retries: int = 2
    """HTTP reward servers: repeats of a failed request (connection error, timeout, HTTP 408/429/5xx) on
    the same server before its shard fails over to the next server; every failed attempt prints one
    line (URL, attempt k/n, cause, next wait). When every server has failed the run stops with exit 3
    naming each URL and cause. rlhforge-specific."""
    retry_backoff_s: float = 1.0
    """HTTP reward servers: wait before the first repeat, doubled for each further one (at most 30 s,
    +-10% jitter; a server's Retry-After is honoured up to that). rlhforge-specific."""
    normalize_enable: bool = False
    """Reward model only: normalise scores with the mean/std stored in the reward model's config."""
    clip_range: tuple[float, float] | None = None
    """Clamp the scalar reward to ``(low, high)``. Ours: off by default (OpenRLHF: (-10, 10))."""
    overlong_buffer_len: int | None = None
    """DAPO soft overlong penalty: the last N tokens before ``rollout.max_new_tokens`` are penalised linearly."""
    overlong_penalty_factor: float = 1.0
    """Maximum overlong penalty."""
    stop_properly_penalty_coef: float | None = None
    """Truncated samples: reward * coef (0 <= coef <= 1) or reward = coef (coef < 0). None disables."""
    offload: bool = False
    """Keep the reward model(s) in host memory between uses (ZeRO-3: DeepSpeed's ``offload_param``)."""
    num_nodes: int = 1
    """Nodes of the reward models' Ray group (Ray workers only: in one process they run in the driver)."""
    num_gpus_per_node: int = 1
    """Reward workers per node (each scores its shard with every reward model). OpenRLHF: 8."""


@dataclass(frozen=True)
class VllmConfig:
    """vLLM generation engines (``num_engines >= 1``; see docs/vllm.md). Unset: the in-process HF engine."""

    num_engines: int | None = None
    """Number of vLLM engines (None/0: the in-process HF engine). Requests go to the least-loaded one."""
    tensor_parallel_size: int = 1
    """vLLM tensor parallelism per engine (GPU; 1 on CPU)."""
    sync_backend: Literal["nccl", "gloo"] = "nccl"
    """Collective of the weight sync from actor rank 0 to the engine actors: ``nccl`` on GPU engines
    (CUDA IPC where an engine shares the sender's GPU), ``gloo`` (host memory). CPU engines always use
    gloo (NCCL needs GPUs). docs/distributed.md."""
    max_restarts: int = 1
    """Engine actors: restarts of an engine that died or stopped answering (its requests go to the
    other engines; a restarted engine is synced to the current weights). rlhforge-specific."""
    request_timeout_s: float = 600.0
    """Engine actors: seconds one generate call may take before the engine counts as hung (restarted
    as if it had died). rlhforge-specific."""
    sync_timeout_s: float = 300.0
    """Engine actors: the deadline of every weight-sync collective (each broadcast's wait, on actor rank 0
    and in every engine; an NCCL group's watchdog gets 2x + 30 s, so the wait ends first and the group is
    aborted) and of the driver's wait on each engine RPC of a sync. An engine
    that dies or hangs during a sync is restarted (as in ``request_timeout_s``) and the group rebuilt at
    the next sync; actor rank 0 is back within this time. Large models need more than a sync takes.
    rlhforge-specific (OpenRLHF: NCCL's 30-minute default)."""
    sync_with_ray: bool = False
    """Ray workers: send the weights through Ray's object store instead of the dedicated group."""
    sync_bucket_mb: int = 128
    """Weight-sync bucket size in MiB (one collective / RPC per bucket). rlhforge-specific."""
    enable_prefix_caching: bool = False
    """vLLM prefix caching (reset after every weight sync)."""
    enforce_eager: bool = False
    """Disable CUDA graphs (always eager on CPU)."""
    enable_sleep: bool = False
    """Sleep vLLM between generation phases (GPU only: vLLM's CPU build has no sleep mode)."""
    gpu_memory_utilization: float = 0.95
    """vLLM's GPU memory fraction (ignored on CPU: there the KV cache is sized to the rollout, 16 MiB-1 GiB, or
    ``VLLM_CPU_KVCACHE_SPACE`` GiB when set; rollout/vllm_memory.py)."""


@dataclass(frozen=True)
class RolloutConfig:
    """Generation: how many prompts per step, samples per prompt, sampling parameters."""

    batch_size: int = 1024
    """Prompts per RL step (global)."""
    n_samples_per_prompt: int = 1
    """Samples generated per prompt (the group size of GRPO/RLOO/...)."""
    micro_batch_size: int = 1
    """Samples per forward pass when computing log-probs, values and reward-model scores (per device)."""
    max_new_tokens: int | None = None
    """Longest response. None: ``data.max_len - prompt length``."""
    temperature: float = 1.0
    """Sampling temperature (the log-probs used for training are taken at this temperature)."""
    top_p: float = 1.0
    """Nucleus sampling."""
    top_k: int = -1
    """Top-k sampling (-1 disables). rlhforge-specific."""
    generate_batch_size: int = 64
    """Sequences per batched ``generate`` call of the HF engine. rlhforge-specific."""
    hf_decode: Literal["auto", "graphs", "eager"] = "eager"
    """The HF engine's decode loop: ``graphs`` a static KV cache with bucketed shapes, captured as CUDA graphs
    on a GPU (run eagerly elsewhere; Llama / Qwen2 / Qwen3 / Mistral text models, else an error at start-up);
    ``eager`` (the default) the dynamic loop (finished rows leave the batch); ``auto`` graphs on CUDA where
    supported, else eager. Same greedy tokens either way (docs/performance.md). ``graphs`` is opt-in until the
    GPU check has run it on a GPU (none was lent when it was written). rlhforge-specific."""
    hf_engine_weights: Literal["auto", "copy"] = "auto"
    """The in-process HF engine's weights: ``auto`` generates with the actor's own module where that is the
    same computation (one process, no Ray, torch strategy below ZeRO-3, no LoRA, the engine in the actor's
    dtype, synchronous training), as TRL does: no copy in memory, nothing to sync, so no fingerprint or probe
    runs (no ``sync/probe_*`` metrics); elsewhere, and with ``copy``, the engine keeps its own copy, loaded and
    checked after every step (docs/rl.md). rlhforge-specific."""
    vllm_generate_batch_size: int | None = None
    """Prompts per generation call (any engine; None: the prompts still missing from the step). Above
    ``rollout.batch_size`` it oversamples: accepted groups beyond the step's ``batch_size`` are kept for
    the next steps (with ``--algo.dynamic_filtering_enable``, fewer refill calls). OpenRLHF allows a
    value above ``rollout.batch_size`` only with ``--train.async_enable``; here sync runs may use it too."""
    max_tokens_per_gpu: int | None = None
    """With ``--train.dynamic_batch_enable``: token budget per device of a no-grad micro-batch (old /
    reference log-probs, values, reward-model scores); None: ``--train.max_tokens_per_gpu``."""


# --------------------------------------------------------------------------------------------- loop


@dataclass(frozen=True)
class RLDSConfig(DSConfig):
    """Training backend, as ``--ds.*`` of the other commands, plus RL-only flags."""

    enable_sleep: bool = False
    """Offload DeepSpeed states between phases (not supported yet)."""
    value_head_prefix: str = "score"
    """Name of the value head of reward and critic models."""


@dataclass(frozen=True)
class RLDataConfig:
    """Prompt data."""

    prompt_dataset: str | None = None
    """Comma-separated files/folders/hub ids or ``builtin:NAME`` (see ``--data.dataset`` of sft)."""
    prompt_probs: str | None = None
    """Comma-separated mixing probabilities, one per prompt dataset."""
    prompt_split: str = "train"
    """Split to read from hub datasets and ``datasets`` folders."""
    input_key: str = "input"
    """Field with the prompt (a string, or a list of chat messages with ``apply_chat_template``)."""
    label_key: str | None = None
    """Field with the label passed to the reward function (e.g. the reference answer)."""
    datasource_key: str = "datasource"
    """Field naming the task of a record (reward routing, per-datasource eval). rlhforge-specific."""
    input_template: str | None = None
    """Template with one ``{}`` wrapped around the prompt when no chat template is applied."""
    apply_chat_template: bool = False
    """Render prompts with the tokenizer's chat template."""
    tokenizer_chat_template: str | None = None
    """Override the tokenizer's chat template (Jinja text or a file)."""
    max_len: int = 2048
    """Longest prompt + response."""
    prompt_max_len: int | None = None
    """Longest prompt in tokens; longer prompts are skipped (the count is printed). None:
    ``max_len - 1``. OpenRLHF 0.9's ``--prompt_max_len``."""
    max_samples: int = 100_000_000
    """Keep at most this many prompts."""
    disable_fast_tokenizer: bool = False
    """Load the slow tokenizer."""
    dataloader_num_workers: int = 0
    """No effect (prints a notice): prompts are tokenised once, before training."""
    image_key: str = "images"
    """Vision-language actors: the record field holding the prompt's images (docs/vlm.md)."""
    max_images_per_prompt: int = 0
    """Vision-language actors: most images per prompt record (0: no bound)."""


@dataclass(frozen=True)
class RLEvalConfig:
    """Evaluation: pass@1 (mean score), pass@n (max over samples), length, truncation, per datasource."""

    dataset: str | None = None
    """Eval prompt files (same syntax as ``--data.prompt_dataset``)."""
    split: str = "train"
    """Split to read."""
    steps: int = -1
    """Evaluate every N RL steps (-1: never; 0 counts as never). Also before the first step when set."""
    temperature: float = 0.6
    """Sampling temperature of eval (0: greedy)."""
    n_samples_per_prompt: int = 4
    """Samples per eval prompt (pass@n)."""
    max_samples: int = 100_000
    """Keep at most this many eval prompts."""
    max_new_tokens: int | None = None
    """Longest eval response (None: ``rollout.max_new_tokens``). rlhforge-specific."""


@dataclass(frozen=True)
class RLCkptConfig(CkptConfig):
    CHECKPOINTS: ClassVar[str] = "checkpoints_ppo_ray"
    max_mem: float = float("inf")
    """Disk budget in GB for the resumable checkpoints: the oldest are removed while their total size
    exceeds it (the newest and the best are kept), as well as beyond ``max_num``."""
    best_metric_key: str = ""
    """Eval metric that picks the best checkpoint (kept beside the newest ones, never rotated away).
    "": ``eval/pass1``; "none" disables."""


@dataclass(frozen=True)
class RLConfig:
    """RL training of the PPO family: PPO with a critic, REINFORCE++(-baseline), GRPO, Dr. GRPO, RLOO, GSPO."""

    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """``--teacher.*``: on-policy distillation's teacher (``--algo.advantage.estimator on_policy_distill``)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: RLTrainConfig = field(default_factory=RLTrainConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    ds: RLDSConfig = field(default_factory=RLDSConfig)
    data: RLDataConfig = field(default_factory=RLDataConfig)
    eval: RLEvalConfig = field(default_factory=RLEvalConfig)
    ckpt: RLCkptConfig = field(default_factory=RLCkptConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    deadline: DeadlineConfig = field(default_factory=DeadlineConfig)
    env: EnvAdapterConfig = field(default_factory=EnvAdapterConfig)
    """``--env.kind verifiers|openenv --env.id ...``: a verifiers or OpenEnv environment (docs/env_adapters.md)."""
    local_rank: int = -1
    """Set by launchers; the rank is read from the environment."""
    use_ms: bool = False
    """Not supported: ModelScope downloads."""

    def validate(self) -> None:
        from rlhforge.config.rl_rules import validate_rl

        validate_rl(self)

    @property
    def planned_micro_batch_size(self) -> int:
        """Samples per micro-batch for the batch arithmetic and DeepSpeed's nominal config:
        ``train.micro_batch_size``, or 1 with ``--train.dynamic_batch_enable`` (token budgets split the
        steps then; OpenRLHF also sets DeepSpeed's micro-batch to 1 there)."""
        return 1 if self.train.dynamic_batch_enable else self.train.micro_batch_size

    def token_budgets(self) -> tuple[int | None, int | None]:
        """``(training, no-grad pass)`` token budgets per micro-batch with ``--train.dynamic_batch_enable``
        (``rollout.max_tokens_per_gpu`` or else the training one for the passes); ``(None, None)`` without.
        The budget is what one worker's micro-batch holds (OpenRLHF multiplies it by the ring-attention x
        tensor-parallel size; here the actor multiplies it by ``ds.ring_attn_size``, the reference and
        critic run without rings and use it as it is)."""
        if not self.train.dynamic_batch_enable:
            return None, None
        return self.train.max_tokens_per_gpu, self.rollout.max_tokens_per_gpu or self.train.max_tokens_per_gpu

    @property
    def uses_critic(self) -> bool:
        return self.algo.advantage.record.critic

    @property
    def uses_teacher(self) -> bool:
        return self.algo.advantage.record.teacher

    @property
    def uses_ref(self) -> bool:
        return self.algo.kl.init_coef > 0
