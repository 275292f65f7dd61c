"""``rlhforge <command> [flags]``: one console script, one module per command."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "quickstart": ("rlhforge.cli.quickstart", "build a tiny model and train it on a built-in task (CPU, minutes)"),
    "rl": ("rlhforge.cli.train_ppo_ray", "RL: PPO, GRPO, REINFORCE++, RLOO, ... (= python -m rlhforge.cli.train_ppo_ray)"),
    "sft": ("rlhforge.cli.train_sft", "supervised fine-tuning (= python -m rlhforge.cli.train_sft)"),
    "rm": ("rlhforge.cli.train_rm", "pairwise reward model (= python -m rlhforge.cli.train_rm)"),
    "dpo": ("rlhforge.cli.train_dpo", "DPO / cDPO / IPO (= python -m rlhforge.cli.train_dpo)"),
    "kto": ("rlhforge.cli.train_kto", "KTO / APO-zero on unpaired data (= python -m rlhforge.cli.train_kto)"),
    "serve-rm": ("rlhforge.cli.serve_rm", "HTTP reward server over a reward model (= python -m rlhforge.cli.serve_rm)"),
    "serve-tinker": ("rlhforge.cli.serve_tinker", "Tinker-compatible training server for the tinker SDK (docs/tinker.md)"),
    "serve-sandbox": ("rlhforge.cli.serve_sandbox", "HTTP code sandbox for tool calls (= python -m rlhforge.cli.serve_sandbox)"),
    "tiny-model": ("rlhforge.cli.tiny_model", "write a tiny model (--arch llama, qwen3, phi3, qwen3_moe, ...) + local BPE tokenizer to a folder"),
    "merge-lora": ("rlhforge.cli.lora_combiner", "merge a LoRA adapter into its base model"),
}


def usage() -> str:
    lines = ["usage: rlhforge <command> [--help] [flags]", "", "commands:"]
    lines += [f"  {name:<12} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"rlhforge: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    from rlhforge.cli.env import setup_cli_environment

    setup_cli_environment()
    module = importlib.import_module(COMMANDS[name][0])
    return module.main(rest, prog=f"rlhforge {name}") or 0


if __name__ == "__main__":
    sys.exit(main())
