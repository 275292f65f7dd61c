import json
from pathlib import Path


def write_sft_data(path: Path, n: int = 48) -> Path:
    """Prompt/response pairs with uneven lengths (so padding and packing differ)."""
    rows = []
    for i in range(n):
        a, b = i % 7, (i * 3) % 5
        rows.append({"input": f"What is {a} + {b}?" + " please" * (i % 4), "output": f"The answer is {a + b}."})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sft_args(model_dir, data, out, *extra):
    return [
        "--model.model_name_or_path", str(model_dir), "--data.dataset", str(data),
        "--data.input_key", "input", "--data.output_key", "output", "--data.apply_chat_template",
        "--data.max_len", "64", "--train.batch_size", "8", "--train.micro_batch_size", "4",
        "--train.max_epochs", "1", "--adam.lr", "1e-3", "--lr_warmup_ratio", "0", "--ds.param_dtype", "fp32",
        "--ckpt.output_dir", str(out), "--ckpt.path", str(Path(out) / "ckpts"), *map(str, extra),
    ]


def losses(run_dir) -> dict[int, float]:
    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "train/loss" in rec:
            out[rec["step"]] = rec["train/loss"]
    return out
