"""Fuzz every reader (config and overrides, study.yaml, run.json, measures.json) with Hypothesis.

    python scripts/fuzz_readers.py           # the CI setting: 40 derandomized examples per reader
    python scripts/fuzz_readers.py --long    # 2,000 fresh random examples per reader (~10 minutes on 2 cores)
    python scripts/fuzz_readers.py --examples 20000

Runs tests/test_fuzz_readers.py: every input must end in a valid object or one `FlatbenchError`, never
in another exception. A failure prints the smallest input Hypothesis found.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", action="store_true", help="2,000 fresh random examples per reader")
    parser.add_argument("--examples", type=int, default=None, help="examples per reader (implies fresh random ones)")
    args, rest = parser.parse_known_args()
    env = dict(os.environ)
    if args.long or args.examples:
        env["FLATBENCH_FUZZ_EXAMPLES"] = str(args.examples or 2000)
        env["FLATBENCH_FUZZ_LONG"] = "1"
    env.setdefault("MPLBACKEND", "Agg")
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "tests/test_fuzz_readers.py", *rest],
                           cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
