"""DeepSpeed ZeRO 0-3 strategy (CPU with gloo, GPU with nccl), with optional optimizer offload."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from rlhforge.backend.device import (collective_timeout_kwargs, destroy_group_at_exit, dist_info, release_deepspeed_groups,
                                    one_rank_store, resolve_device, resolve_dtype, single_process_env)
from rlhforge.backend.optim import build_optimizer, build_scheduler, optimizer_param_groups
from rlhforge.backend.guards import all_ranks_finite, grads_finite, poison_nonfinite
from rlhforge.backend.jit_ops import clear_stale_build_locks
from rlhforge.backend.strategy import all_reduce_tensor


def drop_stale_deepspeed_groups() -> None:
    """Forget DeepSpeed's cached process groups (``deepspeed.utils.groups``: its clone of the world group,
    tensor/data-parallel groups, ``mpu``) when they no longer belong to this process's default group.

    That happens when the default group was destroyed after an earlier DeepSpeed engine in the same
    process (an in-process vLLM engine tears the default group down when it shuts down). A new
    ``init_distributed`` then makes a new default group, but DeepSpeed would keep handing out the old
    groups ("Group ... is not registered"). Call before ``deepspeed.init_distributed``.
    """
    import sys

    import torch.distributed as dist

    groups = sys.modules.get("deepspeed.utils.groups")
    cached = getattr(groups, "_WORLD_GROUP", None) if groups is not None else None
    if cached is None:
        return
    if dist.is_initialized():
        try:
            dist.get_global_rank(cached, 0)
            return  # still registered: nothing stale
        except (ValueError, RuntimeError):
            pass
    release_deepspeed_groups()


def deepspeed_config(ds_cfg, optim_cfg, dtype: torch.dtype, micro_batch_size: int, grad_accum_steps: int) -> dict:
    zero: dict = {
        "stage": ds_cfg.zero_stage,
        "overlap_comm": ds_cfg.overlap_comm,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e7,
        "stage3_gather_16bit_weights_on_model_save": True,
    }
    if ds_cfg.zpg > 1:
        zero["zero_hpz_partition_size"] = ds_cfg.zpg
    if optim_cfg.name == "muon" and ds_cfg.zero_stage == 3:
        zero["reduce_scatter"] = False  # DeepSpeed's ZeRO-3 Muon gathers whole gradients instead
    if ds_cfg.adam_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    config = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        "gradient_clipping": optim_cfg.max_norm if optim_cfg.max_norm > 0 else 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if ds_cfg.grad_accum_dtype:
        config["data_types"] = {"grad_accum_dtype": ds_cfg.grad_accum_dtype}
    if getattr(ds_cfg, "deepcompile", False):  # GPU only (refused on CPU in config/validation.py)
        config["compile"] = {"deepcompile": True}
    if getattr(ds_cfg, "tensor_parallel_size", 1) > 1:  # AutoTP (backend/autotp.py)
        from rlhforge.backend.autotp import autotp_ds_config

        config["tensor_parallel"] = autotp_ds_config(ds_cfg.tensor_parallel_size)
    return config


class DeepSpeedStrategy:
    def __init__(self, ds_cfg, optim_cfg, train_cfg, batch_plan):
        import deepspeed

        info = dist_info()
        self.rank, self.world_size = info.rank, info.world_size
        self.device = resolve_device(train_cfg.device, info.local_rank)
        self.dtype = resolve_dtype(ds_cfg.param_dtype, self.device)
        self.ds_cfg, self.optim_cfg = ds_cfg, optim_cfg
        self.batch_plan = batch_plan
        from rlhforge.backend.autotp import check_tp_size, tp_layout

        self.tp_size = getattr(ds_cfg, "tensor_parallel_size", 1)
        check_tp_size(self.tp_size, self.world_size, ds_cfg.zero_stage)
        # ranks of one AutoTP group see the same samples: data shards are by data-parallel rank
        self.dp_rank, self.dp_size = tp_layout(self.rank, self.world_size, self.tp_size)
        if self.world_size == 1:  # one plain process: a one-rank group on a free local port (no MPI discovery)
            single_process_env()
        drop_stale_deepspeed_groups()
        clear_stale_build_locks()  # a killed build of DeepSpeed's ops would make this wait forever (jit_ops)
        with one_rank_store():  # a one-rank group's store on 127.0.0.1 (torch's would be on every interface)
            deepspeed.init_distributed(dist_backend="nccl" if self.device.type == "cuda" else "gloo",
                                       **collective_timeout_kwargs())
        from rlhforge.backend.strict_device import install

        install()  # RLHFORGE_STRICT_DEVICE=1: collectives checked for the group's device
        destroy_group_at_exit()
        self.engine = None

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    def prepare(self, model: torch.nn.Module, total_steps: int) -> torch.nn.Module:
        import deepspeed

        if self.optim_cfg.name == "muon":
            if self.ds_cfg.adam_offload:
                raise ValueError("--ds.adam_offload with Muon: rlhforge builds DeepSpeed's MuonWithAuxAdam without "
                                 "a CPU optimizer; drop --ds.adam_offload or use adam")
            from rlhforge.backend.optim import deepspeed_muon_optimizer

            optimizer = deepspeed_muon_optimizer(model, self.optim_cfg)  # ZeRO orthogonalises whole matrices
        elif self.ds_cfg.adam_offload:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            a = self.optim_cfg.adam
            optimizer = DeepSpeedCPUAdam(
                optimizer_param_groups(model, a.weight_decay), lr=a.lr, betas=tuple(a.betas), eps=a.eps, adamw_mode=True,
            )
        else:
            optimizer = build_optimizer(model, self.optim_cfg)
        scheduler = build_scheduler(optimizer, self.optim_cfg, total_steps)
        config = deepspeed_config(
            self.ds_cfg, self.optim_cfg, self.dtype, self.batch_plan.micro_batch_size, self.batch_plan.grad_accum_steps
        )
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config
        )
        if getattr(self.ds_cfg, "deepcompile", False):
            self.engine.compile()
        return self.engine

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def autocast(self):
        return contextlib.nullcontext()  # DeepSpeed casts the model itself

    @contextlib.contextmanager
    def model_init(self):
        """Load the model inside this (``with strategy.model_init(): model = from_pretrained(...)``). Under
        ZeRO-3 transformers then builds it inside ``deepspeed.zero.Init`` (a live ``HfDeepSpeedConfig``
        tells it to): each rank holds only its partition from the start, instead of every rank loading the
        whole fp32 model before ``prepare`` shards it. The config object is dropped on exit, so later
        ``from_pretrained`` calls in this process (an engine's copy) load whole models again.

        fp32 training only: in bf16/fp16 ``zero.Init`` also rounds the buffers a model computes at
        construction (rotary ``inv_freq``: 0.56234 -> 0.5625 in bf16), which changes every position's
        encoding (the actor's log-probs then differ from the reference's at step 1); such runs load whole."""
        if self.ds_cfg.zero_stage != 3 or self.tp_size > 1 or self.dtype != torch.float32:
            yield
            return
        from transformers.integrations import HfDeepSpeedConfig

        plan = self.batch_plan
        config = deepspeed_config(self.ds_cfg, self.optim_cfg, self.dtype, plan.micro_batch_size,
                                  plan.grad_accum_steps)
        live = HfDeepSpeedConfig(config)  # transformers holds a weak reference to it
        try:
            yield
        finally:
            del live

    def backward(self, loss: torch.Tensor, is_last_micro_batch: bool = True) -> None:
        # The number of micro-batches per step may vary (token budgets): we own the boundary and the
        # loss scaling (the trainer already divided by the global count), so no 1/GAS here.
        self.engine.set_gradient_accumulation_boundary(is_last_micro_batch)
        self.engine.backward(poison_nonfinite(loss), scale_wrt_gas=False)

    def step(self) -> dict[str, float]:
        """Non-finite steps are skipped (optimizer and scheduler untouched): ZeRO 1-3 detect them
        themselves (their overflow check on the reduced, partitioned gradients, agreed over ranks);
        ZeRO-0 has no such check, so its full local gradients are checked here first."""
        lr = self.scheduler.get_last_lr()[0]
        if self.ds_cfg.zero_stage == 0 and not all_ranks_finite(grads_finite(self.engine.module), self.all_reduce):
            self.engine.zero_grad()
            return {"grad_norm": float("nan"), "lr": float(lr), "skipped": 1.0}
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        return {"grad_norm": norm, "lr": float(lr), "skipped": 0.0 if self.engine.was_step_applied() else 1.0}

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return all_reduce_tensor(tensor, op, self.world_size, self.device)

    def barrier(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()

    def full_state_dict(self):
        """Gather parameters one at a time (ZeRO-3) so peak memory stays one tensor above a shard."""
        import deepspeed

        module = self.engine.module
        out = {} if self.is_rank0 else None
        if self.tp_size > 1:  # AutoTP: gather each split layer in turn
            from rlhforge.backend.autotp import iter_gathered_weights

            for name, tensor in iter_gathered_weights(module):
                if out is not None:
                    out[name] = tensor.to("cpu", torch.float32 if tensor.is_floating_point() else None, copy=True)
            return out
        if self.ds_cfg.zero_stage == 3:
            for name, param in module.named_parameters():
                with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                    if out is not None:
                        out[name] = param.detach().to("cpu", torch.float32, copy=True)
            if out is not None:
                persistent = set(module.state_dict().keys())  # non-persistent buffers (rotary inv_freq) are not saved
                for name, buf in module.named_buffers():
                    if name in persistent:
                        out[name] = buf.detach().to("cpu", copy=True)
                # tied weights appear once in named_parameters; state_dict names them all
                for name in module.state_dict().keys():
                    if name not in out:
                        out[name] = _tied_source(module, name, out)
            return out
        if out is not None:
            out.update({k: v.detach().to("cpu", torch.float32, copy=True) for k, v in module.state_dict().items()})
        return out

    def iter_full_weights(self):
        module = self.engine.module
        if self.tp_size > 1:
            from rlhforge.backend.autotp import iter_gathered_weights

            yield from iter_gathered_weights(module)
            return
        if self.ds_cfg.zero_stage != 3:
            yield from module.state_dict().items()
            return
        import deepspeed

        persistent = set(module.state_dict().keys())  # non-persistent buffers (rotary inv_freq) are not sent
        for name, param in module.named_parameters(remove_duplicate=False):  # tied weights under each name
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                yield name, param.detach()
        for name, buf in module.named_buffers():
            if name in persistent:
                yield name, buf.detach()

    def save_state(self, directory: Path) -> None:
        self.engine.save_checkpoint(str(directory), tag="deepspeed")

    def load_state(self, directory: Path) -> None:
        """With ``--ds.use_universal_ckpt`` a checkpoint saved on another number of ranks is converted
        to DeepSpeed's universal format once and loaded with ``load_universal`` (backend/universal_ckpt.py)."""
        from rlhforge.backend import universal_ckpt

        if self.ds_cfg.use_universal_ckpt:
            tag = universal_ckpt.load_tag(directory, self.world_size, self.is_rank0, self.barrier)
        elif universal_ckpt.needs_universal(directory, self.world_size):
            saved = universal_ckpt.saved_dp_world_size(Path(directory) / universal_ckpt.NATIVE_TAG)
            raise RuntimeError(f"{directory}: saved by {saved} ranks, loading on {self.world_size}; resume on "
                               f"{saved} ranks or pass --ds.use_universal_ckpt to re-partition it")
        else:
            tag = universal_ckpt.NATIVE_TAG
        # DeepSpeed reads the choice from its config at load time; it is made per checkpoint here
        self.engine._config.load_universal_checkpoint = tag == universal_ckpt.UNIVERSAL_TAG
        path, _ = self.engine.load_checkpoint(
            str(directory), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None:
            raise FileNotFoundError(f"{directory}/{tag}: no DeepSpeed checkpoint could be loaded")

    def train(self) -> None:
        self.engine.train()

    def eval(self) -> None:
        self.engine.eval()


def _tied_source(module: torch.nn.Module, name: str, gathered: dict) -> torch.Tensor:
    """Resolve a state-dict key that aliases another parameter (tied embeddings)."""
    target = module.get_parameter(name) if "." in name else getattr(module, name)
    for other, param in module.named_parameters():
        if param is target:
            return gathered[other]
    raise KeyError(name)
