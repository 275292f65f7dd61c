"""Writes the OpenRLHF facts the tests need as the repository's own test data, from the reference
texts kept beside the development checkout (``../shared/reference``, which a user's clone does not have):

- ``openrlhf_0_11_2_flags.json``: every flag of OpenRLHF 0.11.2 per command (name, type/action, default,
  choices, nargs, as written in the appendix of ``openrlhf-cli.md``);
- ``seeds/NNN_train_ppo_ray.txt``: the ``python3 -m openrlhf.cli.train_ppo_ray`` command blocks of each seed
  text (``seeds/NNN_*.txt``), verbatim, under a header naming the source.

    python tests/reference/extract.py [REFERENCE_DIR]            # rewrite the files
    python tests/reference/extract.py [REFERENCE_DIR] --check    # exit 1 if a committed file differs

The tests read only these files (tests/flag_tables.py, tests/rl/test_rl_config.py)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_REFERENCE = HERE.parents[2] / "shared" / "reference"
FLAGS = HERE / "openrlhf_0_11_2_flags.json"
COLUMNS = ("flag", "type", "default", "choices", "nargs")
SEED_COMMAND = "python3 -m openrlhf.cli.train_ppo_ray"


def flag_tables(cli_md: str) -> dict:
    appendix = cli_md.split("## Appendix: every flag of OpenRLHF 0.11.2")[1]
    commands = {}
    for m in re.finditer(r"^### (\w+) \((\d+) flags\)\n(.*?)(?=^### |\Z)", appendix, re.M | re.S):
        rows = [[c.strip() for c in line.split("|")[1:-1]] for line in m.group(3).splitlines()
                if line.startswith("| --")]
        assert len(rows) == int(m.group(2)), (m.group(1), len(rows), m.group(2))
        commands[m.group(1)] = rows
    return {"source": "shared/reference/openrlhf-cli.md, 'Appendix: every flag of OpenRLHF 0.11.2 (the newest "
                      "release), by command' (as declared in each command's argparse parser; help texts omitted)",
            "written_by": "tests/reference/extract.py", "openrlhf_version": "0.11.2", "columns": list(COLUMNS),
            "commands": commands}


def seed_blocks(text: str) -> list[str]:
    """The command blocks: from the line holding ``SEED_COMMAND`` through its ``--flag`` continuation lines."""
    lines, blocks = text.splitlines(), []
    for i, line in enumerate(lines):
        if SEED_COMMAND in line:
            block = [line]
            for nxt in lines[i + 1:]:
                if not nxt.strip().startswith("--"):
                    break
                block.append(nxt)
            blocks.append("\n".join(block))
    return blocks


def dump_flags(data: dict) -> str:
    """JSON with one flag row per line (rows are lists in ``columns`` order)."""
    head = {k: v for k, v in data.items() if k != "commands"}
    text = json.dumps(head, indent=1)[:-2] + ',\n "commands": {\n'
    text += ",\n".join(f"  {json.dumps(name)}: [\n" + ",\n".join("   " + json.dumps(r) for r in rows) + "\n  ]"
                       for name, rows in data["commands"].items())
    return text + "\n }\n}\n"


def outputs(reference: Path) -> dict[Path, str]:
    out = {FLAGS: dump_flags(flag_tables((reference / "openrlhf-cli.md").read_text()))}
    for seed in sorted((reference / "seeds").glob("*.txt")):
        blocks = seed_blocks(seed.read_text())
        if not blocks:
            continue
        header = (f"# The OpenRLHF train_ppo_ray command blocks of shared/reference/seeds/{seed.name}, verbatim\n"
                  f"# (written by tests/reference/extract.py; blocks separated by a blank line)\n\n")
        out[HERE / "seeds" / f"{seed.name.split('_')[0]}_train_ppo_ray.txt"] = header + "\n\n".join(blocks) + "\n"
    return out


def main(argv: list[str]) -> int:
    check = "--check" in argv
    args = [a for a in argv if a != "--check"]
    reference = Path(args[0]) if args else DEFAULT_REFERENCE
    stale = []
    for path, text in outputs(reference).items():
        if check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path.relative_to(HERE)))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"differs from {reference}: {', '.join(stale)}; rerun python tests/reference/extract.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
