"""Put retrained weights back into a committed study, after checking that they are the committed runs'.

    flatbench train configs/cpu/yi_mnist.yaml --out /tmp/retrain      # the same runs, trained again
    python scripts/restore_weights.py results/cpu/yi_mnist /tmp/retrain/yi_mnist

The committed studies (results/cpu/) carry every run's run.json and measures.json but not its model.pt
(weights are not committed). Whatever needs the weights (an audit, scripts/logit_scale.py) needs them back.
Training is deterministic (init, labels and batch order are seeded by the config), so a retrained run has the
same model file: this script copies a retrained run's model.pt into the committed run folder only when its
sha256 equals the `model_sha256` that the committed run.json recorded, and lists every run where it does not
(exit code 1 then). Nothing committed is changed: model.pt is ignored by git.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flatbench.store import MODEL_FILE, RUN_JSON, file_sha256, read_json  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("study", help="the committed study folder, e.g. results/cpu/yi_mnist")
    p.add_argument("retrained", help="the study folder of the retraining, e.g. /tmp/retrain/yi_mnist")
    args = p.parse_args()
    study, retrained = Path(args.study), Path(args.retrained)
    copied, bad = 0, []
    for run_json in sorted((study / "runs").glob(f"*/{RUN_JSON}")):
        run_id = run_json.parent.name
        expected = read_json(run_json).get("model_sha256")
        source = retrained / "runs" / run_id / MODEL_FILE
        if not source.is_file():
            bad.append(f"{run_id}: not retrained")
            continue
        got = file_sha256(source)
        if got != expected:
            bad.append(f"{run_id}: retrained sha256 {got[:12]}…, committed {str(expected)[:12]}…")
            continue
        shutil.copyfile(source, run_json.parent / MODEL_FILE)
        copied += 1
    print(f"{study.name}: {copied} model file(s) restored, identical to the committed runs'")
    for line in bad:
        print(f"  {line}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
