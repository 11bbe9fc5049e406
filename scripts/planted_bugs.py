"""Plant plausible one-line bugs, one at a time, and check that the relevant tests fail.

    python scripts/planted_bugs.py                  # both rounds: one line per bug, caught or MISSED
    python scripts/planted_bugs.py --round 30       # issue 30's round only (scripts/planted_bugs_round30.txt)
    python scripts/planted_bugs.py --round 30 --only isolation   # the bugs whose name holds a word
    python scripts/planted_bugs.py --round 30 --only 'state:'    # issue 44 A: also zeros:, limits:, hang:, stale loss:
    python scripts/planted_bugs.py --round 30 --only 'report:'   # issue 44 B: also args:, io:, hang: aliases

Round 21 (issue 21's "bugs the suite does not catch") plants each bug by monkeypatching inside the pytest
process (a plugin module written to a temporary folder). Round 30 (issue 30: the code that moved:
isolation, typed outputs, strict YAML, exit codes, stale plugins, the check-measure rule, the statistics,
several-batch estimates, Lanczos residuals) edits one line of a *copy* of the source tree (the line must
occur exactly once) and runs the named tests in that copy. Neither ever edits the working tree.
A bug is caught when pytest reports a failure or an error (exit code 1 or 2 after collection).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
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
        r.up_to_date = lambda record, spec, settings, context, model_sha256=None: (record.get("status") in r.DONE and
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


ISO = ["tests/measures/test_fuzz_plugins.py", "tests/measures/test_isolation_edges.py", "tests/test_isolation.py", "-k",
       "fuzz or edges or api or described or as_output or keyboard"]
EXIT = ["tests/test_exit_codes.py", "-k", "not stale and not executor"]
TASKS = ["tests/test_exit_codes.py", "-k", "classify"]
STALE = ["tests/measures/test_isolation_edges.py", "tests/test_exit_codes.py", "-k", "stale"]
RULE = ["tests/measures/test_rules_and_estimates.py"]
STATS = ["tests/analysis/test_jiang.py", "tests/analysis/test_robust.py"]
YAML = ["tests/test_isolation.py", "-k", "duplicate"]
TYPED = ["tests/measures/test_isolation_edges.py", "tests/test_isolation.py", "-k",
         "edges or as_output or api or measure_model_exits"]

SOURCE_BUGS: list[tuple[str, str, str, str, list[str]]] = [
    # (name, file, the line's text, its replacement, the tests to run)
    ("isolation: only the top module's mode is compared", "flatbench/measures/isolation.py",
     "        now, modes_now, grads_now = _walk(model)\n",
     '        now, _, grads_now = _walk(model); modes_now = {**self.modes, "(model)": model.training}\n',
     ISO),
    ("isolation: a tensor's comparison looks at its first elements only", "flatbench/measures/isolation.py",
     "return bool(np.array_equal(flat.numpy(), kept.numpy()))",
     "return bool(np.array_equal(flat.numpy()[:16], kept.numpy()[:16]))", ISO),
    ("isolation: the model is not put back when the measure also raised", "flatbench/measures/isolation.py",
     "    if change:\n        guard.restore(model)", "    if change and error is None:\n        guard.restore(model)", ISO),
    ("isolation: Ctrl-C leaves the changed model", "flatbench/measures/isolation.py",
     "        kept.restore()\n        guard.restore(model)\n        raise",
     "        kept.restore()\n        pass\n        raise", ISO),
    ("isolation: buffers are not guarded", "flatbench/measures/isolation.py",
     '                tensors[f"buffer {name}"] = (name, b)', "                pass", ISO),
    ("isolation: requires_grad is not put back", "flatbench/measures/isolation.py",
     "                p.requires_grad_(self.grads[name])", "                pass", ISO),
    ("timeout: a timer of whole seconds (0.5 s never fires)", "flatbench/measures/isolation.py",
     "signal.setitimer(signal.ITIMER_REAL, float(seconds))", "signal.setitimer(signal.ITIMER_REAL, float(int(seconds)))",
     ISO),
    ("timeout: MeasureTimeout an Exception (a measure's except swallows it)", "flatbench/measures/isolation.py",
     "class MeasureTimeout(BaseException):", "class MeasureTimeout(Exception):", ISO),
    ("isolation: the cache of a changed model is kept", "flatbench/measures/evaluate.py",
     "        ctx.cache.clear()  # anything cached", "        pass  # anything cached", ISO),
    ("typed: a bool is a number", "flatbench/measures/registry.py",
     "if isinstance(value, (bool, np.bool_, str, bytes)):", "if isinstance(value, (np.bool_, str, bytes)):", TYPED),
    ("typed: the headline key is not required", "flatbench/measures/registry.py",
     "    if name not in values:", "    if not values:", TYPED),
    ("typed: inf is finite", "flatbench/measures/evaluate.py",
     "bad = [(key, value) for key, value in values.items() if not math.isfinite(value)]",
     "bad = [(key, value) for key, value in values.items() if math.isnan(value)]", ISO),
    ("typed: info is not checked for JSON", "flatbench/measures/evaluate.py",
     "json_problem(out.info)", "json_problem(out.values)", ISO),
    ("exit codes: measure-model counts only errors as failed", "flatbench/cli.py",
     'failed = df[df["status"].isin(list(FAILED))]', 'failed = df[df["status"].isin(["error"])]', TYPED),
    ("exit codes: runs not trained are not passed on", "flatbench/cli.py",
     "    _exit_on_failures(None, counts, counts.not_trained_ids)", "    _exit_on_failures(None, counts)", EXIT),
    ("exit codes: untrained runs alone exit 0", "flatbench/cli.py",
     "    if failed or untrained:", "    if failed:", EXIT),
    ("exit codes: a finished run without model.pt is not trained", "flatbench/store.py",
     '    if info.get("status") != "finished":\n        return None',
     '    if info.get("status") == "finished":\n        return None', EXIT),
    ("exit codes: a task's untrained runs are those another task holds", "flatbench/study/cluster.py",
     "untrained = [rid for rid in counts.not_trained_ids if rid not in locked]",
     "untrained = [rid for rid in counts.not_trained_ids if rid in locked]", TASKS),
    ("exit codes: a task's entry failures read as damage", "flatbench/study/cluster.py",
     '            return 1, line.split("EntriesFailed: ", 1)[1]', '            return 2, line.split("EntriesFailed: ", 1)[1]',
     TASKS),
    ("exit codes: --measures '' means the config's", "flatbench/cli.py",
     "    if not names:\n        raise FlatbenchError(f\"--measures", "    if not names:\n        return None\n        raise FlatbenchError(f\"--measures",
     EXIT),
    ("strict yaml: a duplicate key is looked up, never recorded", "flatbench/strict_yaml.py",
     "                seen[key] = key_node.start_mark.line", "                seen.setdefault(None, 0)", YAML),
    ("stale: compared by the plugin's path, not its hash", "flatbench/measures/runner.py",
     'return record.get("sha256", "unknown") if isinstance(record, dict) else record',
     'return record.get("source", "unknown") if isinstance(record, dict) else record', STALE),
    ("stale: an edited plugin's entries still count as current", "flatbench/measures/stale.py",
     "    if current is None or stored == current:", "    if current is None or stored:", STALE),
    ("stale: the recorded file is hashed before the loaded plugin", "flatbench/measures/stale.py",
     "    if spec.origin == \"builtin\":\n        return None\n    return spec.origin_sha256",
     "    if spec.origin == \"builtin\":\n        return None\n    return _file_sha256(source) or spec.origin_sha256", STALE),
    ("stale: status counts stale entries as measured", "flatbench/study/status.py",
     "in (*DONE, *FAILED) and k not in stale for k in keys)", "in (*DONE, *FAILED) for k in keys)", STALE),
    ("rule: the relative change of small values is absolute", "flatbench/measures/contract.py",
     "return abs(v1 - v0) / abs(v0)", "return abs(v1 - v0) / max(abs(v0), 1.0)", RULE),
    ("rule: a stochastic exact measure gets the exact tolerance", "flatbench/measures/contract.py",
     "    if spec.stochastic:\n        return STOCHASTIC_RTOL", "    if spec.stochastic and not spec.exact:\n        return STOCHASTIC_RTOL",
     RULE),
    ("rule: the standard errors add instead of in quadrature", "flatbench/measures/contract.py",
     "allowed = STDERRS * math.hypot(stderr_of(before, spec.name), stderr_of(after, spec.name))",
     "allowed = STDERRS * (stderr_of(before, spec.name) + stderr_of(after, spec.name))", RULE),
    ("rule: a variant declares its base's invariances", "flatbench/measures/contract.py",
     "return not spec.base and family in spec.invariant_to", "return family in spec.invariant_to", RULE),
    ("rule: twice the tolerance passes", "flatbench/measures/contract.py",
     "    ok = rel <= tol\n", "    ok = rel <= 2 * tol\n", RULE),
    ("estimates: per-batch weights not squared in the variance", "flatbench/measures/builtin/sharpness.py",
     "variance += weight ** 2 * float(d.var(unbiased=True)) / m",
     "variance += weight * float(d.var(unbiased=True)) / m", RULE),
    ("estimates: the Lanczos residual from the first row", "flatbench/curvature/lanczos.py",
     "resid = beta * evecs[-1, order].abs()", "resid = beta * evecs[0, order].abs()", RULE),
    ("stats: Ψ averages an undefined ψ as 0", "flatbench/analysis/stats/jiang.py",
     "np.where(ok, stack, 0.0).sum(axis=0) / np.maximum(ok.sum(axis=0), 1)",
     "np.where(ok, stack, 0.0).sum(axis=0) / stack.shape[0]", STATS),
    ("stats: CMI counts ordered pairs in diagonal cells", "flatbench/analysis/stats/jiang.py",
     "unordered = np.where(is_diag, per_cell / 2, per_cell)", "unordered = per_cell", STATS),
    ("stats: CMI merges ties in the measure with one order", "flatbench/analysis/stats/jiang.py",
     "vm = (np.sign(chunk[:, i] - chunk[:, j]) + 1).astype(np.int64)",
     "vm = (2 * (chunk[:, i] > chunk[:, j])).astype(np.int64)", STATS),
    ("stats: the worst sign error is the mean", "flatbench/analysis/stats/robust.py",
     "return chosen.mean(axis=1), chosen.max(axis=1)", "return chosen.mean(axis=1), chosen.mean(axis=1)", STATS),
    ("stats: a tied pair is a full sign error", "flatbench/analysis/stats/robust.py",
     "return np.where(sm == 0, 0.5, (sm != sg[None, :]).astype(float))",
     "return np.where(sm == 0, 1.0, (sm != sg[None, :]).astype(float))", STATS),
]

CURV = ["tests/curvature/test_hvp_modes.py", "tests/curvature/test_modern_layers.py", "tests/test_verify.py"]
SOURCE_BUGS += [  # issue 41: no derivative mode trusted unchecked
    ("hvp: auto trusts reverse-over-forward unchecked", "flatbench/curvature/hvp.py",
     '    mode = AUTO_MODE if asked == "auto" else asked\n',
     '    mode = "rev_fwd" if asked == "auto" else asked\n    if asked == "auto":\n        return mode, None, ""\n', CURV),
    ("hvp: a failed check still uses the mode", "flatbench/curvature/hvp.py",
     'return (mode if check.passed else REFERENCE_MODE), check, ""', 'return mode, check, ""', CURV),
    ("hvp: the check's tolerance is 1", "flatbench/curvature/modes.py",
     "return float(torch.finfo(dtype).eps) ** 0.5", "return 1.0", CURV),
    ("fisher-rao: the forward mode used without its check", "flatbench/measures/builtin/fisher_rao.py",
     "        if check.passed:\n", "        if True:\n", ["tests/curvature/test_hvp_modes.py", "tests/test_api.py"]),
]

HOSTILE = ["tests/measures/test_hostile_plugins.py"]
HOSTILE_CLI = ["tests/test_hostile_cli.py", "-k"]
SOURCE_BUGS += [  # issue 44 part A: nothing silently wrong (plugins, models and caches)
    ("state: the caller's inputs and the process are not compared", "flatbench/measures/isolation.py",
     "    outside = state.restore() + kept.restore()", "    outside = []", HOSTILE),
    ("state: module hooks and a patched forward are not compared", "flatbench/measures/isolation.py",
     "        attrs = self._attr_changes() if self.attrs else []", "        attrs = []", HOSTILE),
    ("state: the number of threads is not restored", "flatbench/measures/process_state.py",
     '    ("torch\'s number of threads", torch.get_num_threads, torch.set_num_threads),\n', "", HOSTILE),
    ("state: global module hooks are not guarded", "flatbench/measures/process_state.py",
     'for name in sorted(n for n in vars(torch_module) if n.startswith("_global_"))',
     'for name in sorted(n for n in vars(torch_module) if n.startswith("_no_such_"))', HOSTILE),
    ("state: torch's own functions are not guarded", "flatbench/measures/process_state.py",
     '    ("the torch namespace", *_namespace(torch)),\n', "", HOSTILE),
    ("state: check-measure passes a measure that changed the model", "flatbench/measures/evaluate.py",
     "    if change or isinstance(exc, OutsideChange):", "    if False:", [*HOSTILE, "-k", "check_measure"]),
    ("zeros: a forward pass without a graph gives curvature 0", "flatbench/curvature/common.py",
     "    if not value.requires_grad and (model is None", "    if False and (model is None", HOSTILE),
    ("zeros: path_norm takes a constant scale as it is", "flatbench/measures/builtin/norms.py",
     "                args = (args[0], c * c, *args[2:])", "                args = (args[0], c, *args[2:])", HOSTILE),
    ("limits: no watchdog (an ignored SIGALRM escapes the limit)", "flatbench/measures/isolation.py",
     "        self.token = WATCHDOG.arm(seconds, MeasureTimeout, self.label)", "        self.token = 0",
     [*HOSTILE, "-k", "sigalrm"]),
    ("limits: a swallowed time-out counts as a result", "flatbench/measures/isolation.py",
     "        if fired or (kind is not None and issubclass(kind, MeasureTimeout)):",
     "        if kind is not None and issubclass(kind, MeasureTimeout):", [*HOSTILE, "-k", "swallows"]),
    ("limits: os._exit in a plugin ends the process with exit 0", "flatbench/measures/isolation.py",
     "        with no_process_exit(state.threads):\n            result = fn()", "        if True:\n            result = fn()",
     [*HOSTILE_CLI, "os_exit"]),
    ("limits: a non-daemon plugin thread keeps the command alive", "flatbench/cli.py",
     "        end_if_threads_left(exc.code)", "        pass", [*HOSTILE_CLI, "non_daemon"]),
    ("limits: a process is never ended past the hard deadline", "flatbench/measures/watchdog.py",
     "        if now >= arm.hard and self.owned:", "        if False:", [*HOSTILE_CLI, "swallows"]),
    ("limits: a worker process keeps a plugin's non-daemon thread", "flatbench/study/workers.py",
     "    mp_util.Finalize(None, end_if_threads_left, args=(0,), exitpriority=100)", "    pass",
     [*HOSTILE_CLI, "non_daemon and workers"]),
    ("limits: a worker ended past its hard deadline is a traceback", "flatbench/study/workers.py",
     "    except BrokenProcessPool:", "    except ZeroDivisionError:", [*HOSTILE_CLI, "swallows and workers"]),
    ("hang: check-measure without a time limit", "flatbench/measures/contract.py",
     "        first = run_measure(spec, ctx, settings, timeout_s)", "        first = run_measure(spec, ctx, settings)",
     [*HOSTILE, "-k", "check_measure"]),
    ("hang: a pending time-out cleared with NULL (the eval breaker stays signalled)", "flatbench/measures/watchdog.py",
     "                _clear_own_pending()  # arm.ident is this thread: `arm` arms the calling thread",
     "                _raise_in(arm.ident, None)", [*HOSTILE, "-k", "profiler"]),
    ("io: runs/ as a file read as an experiment with no runs", "flatbench/store.py",
     "    if path.exists() and not path.is_dir():", "    if False:",
     ["tests/test_hostile_inputs.py", "-k", "runs_replaced"]),
    ("io: a linked measures.json replaced by a regular file", "flatbench/store.py",
     "    if path.is_symlink():\n        raise OSError(errno.ELOOP", "    if False:\n        raise OSError(errno.ELOOP",
     ["tests/test_hostile_inputs.py", "-k", "linked_result"]),
    ("args: --plot onto a folder found only after computing", "flatbench/api.py",
     "    if path.is_dir():", "    if False:", ["tests/test_hostile_inputs.py", "-k", "plot_onto"]),
    ("stale loss: an edited loss file's entries are kept", "flatbench/measures/runner.py",
     "            or not same_loss(results.get(key, {}), loss)]", "            ]", [*HOSTILE_CLI, "edited_loss"]),
    ("stale loss: status does not see an edited loss file", "flatbench/measures/stale.py",
     '        if now is not None and now != loss.get("sha256"):', "        if False:", [*HOSTILE_CLI, "edited_loss"]),
    ("stale loss: two loss files of one function name share entries", "flatbench/study/spec.py",
     "    if clash:", "    if False:", [*HOSTILE_CLI, "share_a_name"]),
]

B = ["tests/test_hostile_inputs.py", "-k"]
SOURCE_BUGS += [  # issue 44 part B: nothing silently wrong (damaged runs, I/O errors, hostile input)
    ("report: a run.json describing another run is trusted", "flatbench/study/validity.py",
     "    if stored.run_id() != run_path.name:", "    if False:", [*B, "report_refuses or impossible"]),
    ("report: one run.json reached twice counts twice", "flatbench/study/report.py",
     "        if problem is None and real in seen:", "        if False:", [*B, "two_experiments"]),
    ("report: impossible accuracies are not damage", "flatbench/store.py",
     "            problem = _metric_range_problem(key, float(info[key]))", "            problem = None",
     [*B, "impossible"]),
    ("report: a failed report leaves its partial files", "flatbench/study/kept.py",
     "            _restore(folder, kept, set(files), set(dirs))", "            pass", [*B, "part_way"]),
    ("args: compare takes any τ", "flatbench/study/compare.py",
     '        return -1.0, 1.0, "a correlation"', '        return -9e9, 9e9, "a correlation"', [*B, "impossible_correlation"]),
    ("args: compare reads a file cut mid-row", "flatbench/study/compare.py",
     '    if not text.endswith("\\n"):', "    if False:", [*B, "cut_anywhere"]),
    ("io: an unreadable model.pt stops the stage", "flatbench/measures/runner.py",
     "        except OSError as exc:  # this model's files", "        except ZeroDivisionError as exc:  # this model's files",
     [*B, "io_error"]),
    ("io: a worker's I/O error stops the stage", "flatbench/study/measure.py",
     "    except OSError as exc:  # as in this process", "    except ZeroDivisionError as exc:  # as in this process",
     [*B, "worker_job"]),
    ("hang: aliases expand without bound", "flatbench/strict_yaml.py",
     "        if node is not None and _expanded_size(node) > MAX_NODES:", "        if False:", [*B, "laughs"]),
    ("args: a factory's sys.exit(0) ends the command", "flatbench/models.py",
     "    except SystemExit as exc:  # sys.exit(0)", "    except ZeroDivisionError as exc:  # sys.exit(0)", [*B, "factory"]),
    ("args: integer outputs pass the trial forward", "flatbench/measures/arguments.py",
     "    if not out.dtype.is_floating_point:", "    if False:", [*B, "factory"]),
    ("args: measures=None reaches list()", "flatbench/api.py",
     "    if isinstance(given, (list, tuple)) and all(isinstance(g, (str, Path)) for g in given):",
     "    if isinstance(given, (list, tuple)) or given is None or isinstance(given, int):", [*B, "api"]),
    ("args: n_examples above the data silently capped", "flatbench/api.py",
     "    if n_examples is not None and x.shape[0] < n_examples and not at_most:", "    if False:",
     [*B, "api"]),
    ("args: no cap on count settings", "flatbench/measures/registry.py",
     "        if kind == \"min\" and isinstance(value, int) and value > MAX_COUNT:", "        if False:", [*B, "api"]),
    ("args: density sigma finer than its grid", "flatbench/measures/builtin/hessian.py",
     "    if sigma < finest:", "    if False:", [*B, "api"]),
    ("args: 1e-3 is a string", "flatbench/strict_yaml.py",
     'StrictLoader.add_implicit_resolver("tag:yaml.org,2002:float", EXPONENT_FLOAT, list("-+0123456789"))', "",
     [*B, "exponent"]),
    ("args: a tab in a measure name", "flatbench/measures/registry.py",
     'MEASURE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\\-]*")', 'MEASURE_NAME = re.compile(r"[^:@/,]+")',
     [*B, "names"]),
    ("args: describe prints terminal sequences", "flatbench/errors.py",
     '    return "\\n".join(one_line(line) for line in str(text).split("\\n"))', "    return str(text)",
     [*B, "escape"]),
]

BLOCKED = ["tests/analysis/test_blocked.py", "tests/analysis/test_bootstrap.py"]
SOURCE_BUGS += [  # issue 42: τ within draws, its clustered bootstrap, the leave-one-draw-out baseline
    ("blocked: the headline τ is not stratified by draw", "flatbench/analysis/stats/plan.py",
     "        values[\"kendall_tau\"] = stratified_kendall(x, plan.gap, design.draws)",
     "        values[\"kendall_tau\"] = stratified_kendall(x, plan.gap, None)", BLOCKED),
    ("blocked: the bootstrap τ* counts pairs across draws", "flatbench/analysis/stats/compare.py",
     "        if key not in self._boots and len(np.unique(self.draws[mask])) > 1:",
     "        if key not in self._boots and False:", BLOCKED),
    ("blocked: the bootstrap ignores the draw weights (draws not clustered)", "flatbench/analysis/stats/blocked.py",
     "        out += boot.beta * boot.draw_weights[:, d] * 0.5 * s", "        out += boot.beta * 0.5 * s", BLOCKED),
    ("blocked: ref.hyperparameters keeps the run's own draw", "flatbench/analysis/stats/baselines.py",
     "    if drw.max() == 0:", "    if True:", BLOCKED),
]

COPY_IGNORE = shutil.ignore_patterns(".git", "results", "__pycache__", ".hypothesis", ".pytest_cache", "*.egg-info",
                                     "docs", "examples")


def plant_source(bug: tuple[str, str, str, str, list[str]]) -> tuple[bool, str]:
    """Plant one source bug in a copy of the tree and run its tests there: (caught, pytest's last line)."""
    name, rel, old, new, tests = bug
    with tempfile.TemporaryDirectory(prefix="flatbench-plant30-") as tmp:
        copy = Path(tmp) / "tree"
        shutil.copytree(ROOT, copy, ignore=COPY_IGNORE)
        path = copy / rel
        text = path.read_text()
        if text.count(old) != 1:
            return False, f"NOT PLANTED: the line occurs {text.count(old)} times in {rel}"
        path.write_text(text.replace(old, new))
        env = {**os.environ, "PYTHONPATH": str(copy), "MPLBACKEND": "Agg", "PYTHONDONTWRITEBYTECODE": "1"}
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", "-W",
                                 "ignore", *tests], cwd=copy, env=env, capture_output=True, text=True)
        last = (result.stdout.strip().splitlines() or [""])[-1]
        return result.returncode in (1, 2) and "no tests ran" not in last, last


def round_30(only: str | None) -> int:
    missed = planted = 0
    for bug in SOURCE_BUGS:
        if only and only not in bug[0]:
            continue
        start = time.monotonic()
        caught, last = plant_source(bug)
        planted += 1
        missed += not caught
        print(f"{'caught' if caught else 'MISSED'}: {bug[0]} ({bug[1]}; {' '.join(bug[4])}) -> {last} "
              f"[{time.monotonic() - start:.0f} s]", flush=True)
    print(f"round 30: {planted} planted, {planted - missed} caught, {missed} missed", flush=True)
    return missed


def round_21() -> int:
    plugins = Path(tempfile.mkdtemp(prefix="flatbench-plant-"))
    missed = 0
    for i, (bug, (tests, code)) in enumerate(BUGS.items()):
        name = f"plant_{i}"
        (plugins / f"{name}.py").write_text(textwrap.dedent(code))
        env = {**os.environ, "PYTHONPATH": f"{plugins}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "MPLBACKEND": "Agg"}
        path, *rest = tests.split(" ", 1)
        args = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", name, path]
        if rest:
            args += ["-k", rest[0].split("-k ", 1)[1].strip("'")]
        result = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
        caught = result.returncode == 1
        missed += not caught
        last = (result.stdout.strip().splitlines() or [""])[-1]
        print(f"{'caught' if caught else 'MISSED'}: {bug}: {tests} -> {last}")
    return missed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--round", choices=["21", "30", "all"], default="all")
    parser.add_argument("--only", default=None, help="Round 30: only the bugs whose name holds this text.")
    args = parser.parse_args()
    missed = 0
    if args.round in ("21", "all"):
        missed += round_21()
    if args.round in ("30", "all"):
        missed += round_30(args.only)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
