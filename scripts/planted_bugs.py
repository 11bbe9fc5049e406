"""Plant each bug of issue 21's "bugs the suite does not catch", one at a time, and check that a test fails.

    python scripts/planted_bugs.py            # one line per bug: the test run and whether it failed

Every bug is planted by monkeypatching inside the pytest process (a plugin module written to a temporary
folder), never by editing a source file, so the working tree is never left with a bug in it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BUGS = {
    "evaluation pass in train mode": ("tests/test_planted_bugs.py -k 'evaluate or batchnorm'", '''
        import torch, torch.nn.functional as F
        import flatbench.training.endpoint as endpoint
        import flatbench.training.loop as loop

        @torch.no_grad()
        def evaluate(model, x, y, batch_size):
            loss_sum, correct = 0.0, 0
            for i in range(0, x.shape[0], batch_size):
                logits = model(x[i:i + batch_size])
                loss_sum += F.cross_entropy(logits.float(), y[i:i + batch_size], reduction="sum").item()
                correct += int((logits.argmax(1) == y[i:i + batch_size]).sum())
            n = max(int(x.shape[0]), 1)
            return loss_sum / n, correct / n
        endpoint.evaluate = loop.evaluate = evaluate
    '''),
    "identity ignores train.weight_decay": ("tests/test_planted_bugs.py -k identity", '''
        import flatbench.config as c
        old = c.RunConfig.identity
        c.RunConfig.identity = lambda self: {k: v for k, v in old(self).items() if k != "train.weight_decay"}
    '''),
    "identity ignores data.n_train": ("tests/test_planted_bugs.py -k identity", '''
        import flatbench.config as c
        c.EXECUTION_ONLY_KEYS = c.EXECUTION_ONLY_KEYS | {"data.n_train"}
    '''),
    "measure cache ignores the context": ("tests/test_planted_bugs.py -k context", '''
        import flatbench.measures.runner as r
        r._up_to_date = lambda record, settings, context: (record.get("status") in r.DONE and
            {k: v for k, v in (record.get("settings") or {}).items() if k != "loss"} == settings)
    '''),
    "measure context without n_examples": ("tests/test_planted_bugs.py -k context", '''
        import flatbench.measures.runner as r
        r.measurement_context = lambda cfg: {"dtype": cfg.dtype, "normalized_ce_tau": cfg.normalized_ce_tau}
    '''),
    "granulated τ with τ-b": ("tests/test_planted_bugs.py -k granulated", '''
        import flatbench.analysis.stats.jiang as j
        from scipy.stats import kendalltau
        j.kendall_tau_a = lambda a, b: float(kendalltau(a, b).statistic)
    '''),
}


def main() -> int:
    plugins = Path(tempfile.mkdtemp(prefix="flatbench-plant-"))
    missed = 0
    for i, (bug, (tests, code)) in enumerate(BUGS.items()):
        name = f"plant_{i}"
        (plugins / f"{name}.py").write_text(textwrap.dedent(code))
        env = {**os.environ, "PYTHONPATH": f"{plugins}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "MPLBACKEND": "Agg"}
        path, *rest = tests.split(" ", 1)
        args = [sys.executable, "-m", "pytest", "-q", "-p", name, path]
        if rest:
            args += ["-k", rest[0].split("-k ", 1)[1].strip("'")]
        result = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
        caught = result.returncode == 1
        missed += not caught
        last = (result.stdout.strip().splitlines() or [""])[-1]
        print(f"{'caught' if caught else 'MISSED'}: {bug}: {tests} -> {last}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
