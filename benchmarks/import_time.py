"""What `import trl_distill` costs against its floor, `from trl import SFTConfig` (transformers, peft, accelerate and
TRL's config: what our config subclasses): each in a fresh interpreter, alternated, `--repeats` times; medians and their
ratio (goal: at most 1.1). Also the top entries of ``python -X importtime -c "import trl_distill"``. Writes
benchmarks/results/import_time.{json,md}.

    python benchmarks/import_time.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import ROOT, machine

STATEMENTS = {"trl_distill": "import trl_distill", "floor": "from trl import SFTConfig"}
GOAL = 1.1


def seconds(statement: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", statement], check=True, capture_output=True)
    return time.perf_counter() - start


def top_imports(statement: str, count: int = 12) -> list[tuple[str, float]]:
    """The modules with the largest cumulative import time (seconds), outermost of each chain first."""
    err = subprocess.run([sys.executable, "-X", "importtime", "-c", statement], check=True, capture_output=True,
                         text=True).stderr
    rows = []
    for line in err.splitlines():
        if line.startswith("import time:") and "cumulative" not in line:
            _, cumulative, name = line[len("import time:"):].split("|")
            rows.append((name.strip(), int(cumulative) / 1e6))
    return sorted(rows, key=lambda row: -row[1])[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output_dir", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    seconds("import trl_distill")  # warm the file cache and the bytecode of both
    times = {name: [] for name in STATEMENTS}
    for _ in range(args.repeats):
        for name, statement in STATEMENTS.items():
            times[name].append(seconds(statement))
    medians = {name: statistics.median(values) for name, values in times.items()}
    ratio = medians["trl_distill"] / medians["floor"]
    report = {"machine": machine(), "statements": STATEMENTS, "seconds": times, "medians": medians, "ratio": ratio,
              "goal": GOAL, "top_imports": top_imports(STATEMENTS["trl_distill"])}
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "import_time.json").write_text(json.dumps(report, indent=1))
    lines = [f"| statement | median of {args.repeats} (s) |", "|---|---|"]
    lines += [f"| `{STATEMENTS[name]}` | {medians[name]:.2f} |" for name in STATEMENTS]
    lines += ["", f"ratio {ratio:.3f} (goal ≤ {GOAL}), load average {report['machine']['load_average'][0]:.2f}", "",
              "| module (`-X importtime`, cumulative) | s |", "|---|---|"]
    lines += [f"| {name} | {value:.2f} |" for name, value in report["top_imports"]]
    (out / "import_time.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
