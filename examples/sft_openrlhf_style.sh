#!/usr/bin/env bash
# An OpenRLHF train_sft launch, with only the module name changed (0.11 dotted flags).
# The tiny model and built-in data stand in for a real checkpoint and dataset.
set -euo pipefail
rlhforge tiny-model --out runs/tiny
deepspeed --num_gpus 2 --module rlhforge.cli.train_sft \
  --model.model_name_or_path runs/tiny \
  --data.dataset builtin:arithmetic?n=2000 \
  --data.input_key prompt --data.output_key completion --data.apply_chat_template \
  --data.max_len 128 --train.micro_batch_size 4 --train.batch_size 16 --train.max_epochs 1 \
  --ds.zero_stage 2 --adam.lr 5e-4 --lr_scheduler cosine_with_min_lr --max_norm 1.0 \
  --ds.packing_samples --ckpt.output_dir runs/sft_openrlhf --ckpt.save_steps 50 --logger.logging_steps 5
