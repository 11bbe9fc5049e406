"""Vectorized training: a group of runs of one sweep trained at once as one stacked model.

Small models (mlp, lenet) leave a GPU idle: each step is a handful of tiny kernels. Runs of a sweep that
differ only in their seed, data draw and random labels (`seed`, `data.seed`, `data.random_label_ratio`,
`data.random_label_scheme`) have parameters of the same shapes, so G of them can be stacked along a new
leading dimension and trained by one `torch.func.vmap`-ed `functional_call`: every layer becomes one
batched kernel for the whole group.

Each run of a group keeps everything it has when trained alone:
- its initial weights (`setup.init_model`, seeded by its seed and model fields, never by its run id),
- its training set and labels (`data.load_dataset` with its own data draw and ratio; equal inputs are shared),
- its batch order and augmentation (the same `seeding.batch_generator` / `augment_generator` streams as
  `loop.train_epoch`),
- its optimizer state: Adam and SGD update each element from that element's gradient and state alone,
  and the group's loss is the sum of the runs' mean losses, so one torch optimizer over the stacked
  tensors performs every run's own update (learning rate, weight decay and schedule are shared by
  construction: they are part of the group key);
- its files: run.json, per-epoch checkpoint.pt in the sequential format (so a run may be resumed either
  way) and model.pt, written through the same functions as `loop.train_run`.
Weights equal those of sequential training up to float rounding (batched and single matrix products
round differently); tests/training/test_vectorized.py checks this.

Early stopping (`train.target_train_acc`, `train.target_train_loss`): a run that reaches its target at the end of an epoch is
finished (evaluated and written) and leaves the group; the others go on with the group re-stacked
without it, so it is frozen exactly at that epoch. With a step-level endpoint (`train.endpoint_tolerance`)
the group's state is captured at each epoch's start, and a run whose epoch ended at or below its target is
put back at that start and replays the epoch alone, step by step, to its own stopping step
(`crossing.seek_crossing`); the others go on. Runs resumed from checkpoints of different epochs
are trained as separate sub-groups.

Only models without batch norm and dropout are grouped (mlp with `batch_norm: false`, lenet): their
forward pass of one run never depends on another run's examples. `train.vectorize` chooses the group size:
`off`, a number N, or `auto` (groups of `AUTO_GROUP_SIZE` on CUDA; off on the CPU, where
scripts/bench_train.py measured the stacked model to be no faster than one run after another).
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from tqdm.auto import tqdm

from flatbench.config import RunConfig
from flatbench.data import load_dataset
from flatbench.errors import Echo
from flatbench.seeding import augment_generator, batch_generator
from flatbench.locks import RunLock, RunLocked
from flatbench.models import model_vectorizable
from flatbench.store import CHECKPOINT_FILE, RUN_JSON, atomic_write_json, run_dir
from flatbench.training.batches import augment_batch, epoch_batches
from flatbench.training.crossing import crossed, end_check, record_stop, seek_crossing
from flatbench.training.endpoint import (EpochStats, TrainingDiverged, check_finite_loss, epoch_record,
                                         progress_fields, reached_endpoint, step_endpoint)
from flatbench.training.loop import finish_run
from flatbench.training.outcome import TrainOutcome
from flatbench.training.run_folder import check_run_dir, restore_run, save_snapshots, start_info, write_checkpoint
from flatbench.training.setup import (autocast, init_model, make_optimizer, make_optimizer_for, make_scheduler,
                                      steps_per_batch)
from flatbench.training.signals import Preempted, StopFlag

AUTO_GROUP_SIZE = 16
"""Group size of `train.vectorize: auto` on CUDA devices."""


# ---------------------------------------------------------------- planning


def vectorizable(cfg: RunConfig) -> bool:
    """Whether a run's model can be trained in a group, as its model's registration says (mlp without batch
    norm, lenet)."""
    return model_vectorizable(cfg.model)


def group_size(cfg: RunConfig, device: torch.device) -> int:
    """How many runs like this one train together on `device` (1: one after another)."""
    setting = cfg.train.vectorize
    if setting == "off" or not vectorizable(cfg):
        return 1
    if setting == "auto":
        return AUTO_GROUP_SIZE if torch.device(device).type == "cuda" else 1
    return int(setting)


def group_key(cfg: RunConfig) -> RunConfig:
    """What runs of one group share: the config with seed, data draw and random-label settings blanked out."""
    return replace(cfg, seed=0, data=replace(cfg.data, seed=None, random_label_ratio=0.0,
                                             random_label_scheme="uniform"))


def plan_groups(runs: list[tuple[str, RunConfig]], device: torch.device) -> list[list[tuple[str, RunConfig]]]:
    """Split runs into groups to train at once (in order of first appearance); a group of one trains alone."""
    planned: list[list[tuple[str, RunConfig]]] = []
    open_groups: dict[RunConfig, list[tuple[str, RunConfig]]] = {}
    for rid, cfg in runs:
        size = group_size(cfg, device)
        if size <= 1:
            planned.append([(rid, cfg)])
            continue
        key = group_key(cfg)
        current = open_groups.get(key)
        if current is None or len(current) >= size:
            current = []
            open_groups[key] = current
            planned.append(current)
        current.append((rid, cfg))
    return planned


# ---------------------------------------------------------------- the stacked model


@dataclass
class Member:
    """One run inside a group. `model`, `opt` and `sched` are the run's own (as sequential training builds
    them); they receive the run's slice of the group after every epoch, for its checkpoint and model.pt."""

    run_id: str
    cfg: RunConfig
    ds: Any
    model: nn.Module
    opt: torch.optim.Optimizer
    sched: Any
    start_epoch: int = 0
    history: list[dict] = field(default_factory=list)
    path: Path | None = None
    info: dict = field(default_factory=dict)
    last_check: float | None = None
    """The training-set loss at the end of the run's last epoch, where it was checked."""
    seek: dict | None = None
    """Where a step-level endpoint stopped the run inside an epoch: what the search found."""


def new_member(run_id: str, cfg: RunConfig, ds: Any, device: torch.device) -> Member:
    """A fresh run (seeded init, new optimizer), not tied to any folder (what the benchmark uses)."""

    model = init_model(run_id, cfg, ds.input_shape, ds.num_classes, device)
    opt = make_optimizer(model, cfg)
    return Member(run_id, cfg, ds, model, opt, make_scheduler(opt, cfg))


def _hyper(opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {k: v for k, v in opt.param_groups[0].items() if k != "params"}


class VectorizedGroup:
    """G runs as stacked parameters (G, *shape) trained by one vmap-ed forward and one optimizer."""

    def __init__(self, members: list[Member], device: torch.device):
        if not members:
            raise ValueError("a vectorized group needs at least one run")
        self.device = torch.device(device)
        self.cfg = members[0].cfg
        key = group_key(self.cfg)
        for m in members:
            if group_key(m.cfg) != key:
                raise ValueError(f"run {m.run_id} differs from {members[0].run_id} in more than seed, data draw "
                                 "and labels")
            if m.start_epoch != members[0].start_epoch:
                raise ValueError("runs of one group must start at the same epoch")
        template = members[0].model
        if any(True for _ in template.buffers()) or any(
                isinstance(mod, (nn.modules.batchnorm._BatchNorm, nn.Dropout)) for mod in template.modules()):
            raise ValueError(f"model '{self.cfg.model.name}' has batch norm, dropout or buffers: not vectorizable")
        self.members = list(members)
        self.names = [name for name, _ in template.named_parameters()]
        self.base = copy.deepcopy(template).to("meta")
        params = {n: torch.stack([dict(m.model.named_parameters())[n].detach() for m in members])
                  for n in self.names}
        states = {n: self._stack_state([m.opt.state.get(dict(m.model.named_parameters())[n], {})
                                        for m in members]) for n in self.names}
        self._build(params, states, _hyper(members[0].opt),
                    members[0].sched.state_dict() if members[0].sched is not None else None)
        self._share_data()

        def one(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            return functional_call(self.base, p, (x,))

        forward = torch.vmap(one)
        self.forward = torch.compile(forward) if self.cfg.train.compile else forward

    # ---- optimizer state: stacking, slicing, writing back

    @staticmethod
    def _stack_state(states: list[dict]) -> dict[str, Any]:
        """Per-run optimizer states of one parameter → one state of the stacked parameter."""
        if not any(states):
            return {}
        if not all(states):
            raise ValueError("runs of one group must all have optimizer state, or none")
        out: dict[str, Any] = {}
        for key, first in states[0].items():
            values = [s[key] for s in states]
            if isinstance(first, torch.Tensor) and first.dim() > 0:
                out[key] = torch.stack(values)
            elif isinstance(first, torch.Tensor):  # Adam's step counter: one per group
                if any(not torch.equal(v, first) for v in values):
                    raise ValueError("runs of one group must have taken the same number of steps")
                out[key] = first.clone()
            else:
                out[key] = first
        return out

    def _build(self, params: dict[str, torch.Tensor], states: dict[str, dict], hyper: dict[str, Any],
               sched_state: dict | None) -> None:

        self.params = {n: p.detach().clone().requires_grad_(True) for n, p in params.items()}
        self.opt = make_optimizer_for([self.params[n] for n in self.names], self.cfg)
        self.sched = make_scheduler(self.opt, self.cfg)
        self.opt.param_groups[0].update(hyper)  # lr (and initial_lr) as the runs have them now
        if self.sched is not None and sched_state is not None:
            self.sched.load_state_dict(sched_state)
        for n in self.names:
            if states.get(n):
                self.opt.state[self.params[n]] = dict(states[n])

    def _is_stacked(self, name: str, value: Any) -> bool:
        return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == self.params[name].shape

    def _share_data(self) -> None:
        """Inputs (G runs may share them) and per-run labels as tensors indexed by batch indices."""
        unique: list[torch.Tensor] = []
        which: list[int] = []
        for m in self.members:
            for u, x in enumerate(unique):
                if x is m.ds.x_train or (x.shape == m.ds.x_train.shape and torch.equal(x, m.ds.x_train)):
                    which.append(u)
                    break
            else:
                unique.append(m.ds.x_train)
                which.append(len(unique) - 1)
        n = {int(m.ds.n_train) for m in self.members}
        if len(n) != 1:
            raise ValueError("runs of one group must have training sets of the same size")
        self.n_train = n.pop()
        self._x_single = unique[0] if len(unique) == 1 else None
        self._x_stack = torch.stack(unique) if len(unique) > 1 else None
        self._which = torch.tensor(which, device=self.device)
        self._y = torch.stack([m.ds.y_train for m in self.members])

    def keep(self, indices: list[int]) -> None:
        """Continue with the members at `indices` only (the others finished)."""
        idx = torch.tensor(indices, device=self.device, dtype=torch.long)
        params = {n: self.params[n].detach()[idx] for n in self.names}
        states = {}
        for n in self.names:
            st = self.opt.state.get(self.params[n], {})
            states[n] = {k: (v[idx] if self._is_stacked(n, v) else v) for k, v in st.items()}
        self._build(params, states, _hyper(self.opt), self.sched.state_dict() if self.sched else None)
        self.members = [self.members[i] for i in indices]
        if self._x_stack is not None:
            self._which = self._which[idx]
        self._y = self._y[idx]

    @torch.no_grad()
    def write_back(self) -> None:
        """Copy each run's slice (weights, optimizer state, lr, schedule) into its own model and optimizer."""
        states = {n: self.opt.state.get(self.params[n], {}) for n in self.names}
        sched_state = self.sched.state_dict() if self.sched is not None else None
        for g, m in enumerate(self.members):
            _write_member(m, g, self.params, states, _hyper(self.opt), sched_state)

    def capture(self) -> dict[str, Any]:
        """The group's state now (copies), to put a member back at it later (`restore_member`)."""
        return {"ids": [m.run_id for m in self.members],
                "params": {n: self.params[n].detach().clone() for n in self.names},
                "states": {n: {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                               for k, v in self.opt.state.get(self.params[n], {}).items()} for n in self.names},
                "hyper": copy.deepcopy(_hyper(self.opt)),
                "sched": copy.deepcopy(self.sched.state_dict()) if self.sched is not None else None}

    def restore_member(self, captured: dict[str, Any], m: Member) -> None:
        """Put a member's own model, optimizer and schedule at its slice of a `capture`d group state."""
        g = captured["ids"].index(m.run_id)
        _write_member(m, g, captured["params"], captured["states"], captured["hyper"], captured["sched"])

    @torch.no_grad()
    def load_member(self, m: Member) -> None:
        """Put a member's own weights and optimizer state into its slice of the group (after it trained an
        epoch alone, `_seek_crossed`)."""
        g = self.members.index(m)
        own = dict(m.model.named_parameters())
        for n in self.names:
            self.params[n][g].copy_(own[n])
            mine = m.opt.state.get(own[n], {})
            for k, v in self.opt.state.get(self.params[n], {}).items():
                if self._is_stacked(n, v):
                    v[g].copy_(mine[k])

    # ---- training

    def train_epoch(self, epoch: int, stop: Any = None) -> list[tuple[float, float]]:
        """One epoch of every member: (mean train loss, train accuracy) per member, in member order."""
        cfg, dev = self.cfg, self.device
        per_step = self.sched is not None and steps_per_batch(cfg)
        G, n, bs = len(self.members), self.n_train, cfg.train.batch_size
        perms = torch.stack([torch.cat(epoch_batches(n, bs, batch_generator(m.cfg,
                                                                           epoch, device=dev)))
                             for m in self.members])
        aug_gens = [augment_generator(m.cfg, epoch, device=dev) for m in self.members] \
            if cfg.data.augment else None
        augment = self.members[0].ds.augment_params()
        loss_sum = torch.zeros(G, dtype=torch.float64, device=dev)
        correct = torch.zeros(G, dtype=torch.long, device=dev)
        for idx in perms.split(bs, dim=1):
            if stop is not None:
                stop.check()
            if self._x_single is not None:
                x = self._x_single[idx]
            else:
                x = self._x_stack[self._which[:, None], idx]
            if aug_gens is not None:
                x = torch.stack([augment_batch(x[g], aug_gens[g], **augment) for g in range(G)])
            y = self._y.gather(1, idx)
            B = idx.shape[1]
            with autocast(cfg, dev):
                logits = self.forward(self.params, x)
                losses = F.cross_entropy(logits.reshape(G * B, -1), y.reshape(-1), reduction="none")
                losses = losses.float().view(G, B).mean(dim=1)
            self.opt.zero_grad(set_to_none=True)
            losses.sum().backward()
            self.opt.step()
            if per_step:
                self.sched.step()
            loss_sum += losses.detach().double() * B
            correct += (logits.detach().argmax(dim=-1) == y).sum(dim=1)
        return [(loss / n, c / n) for loss, c in zip(loss_sum.tolist(), correct.tolist())]

    def step_schedule(self) -> None:
        """End of an epoch: step an epoch schedule (a per-step one stepped inside `train_epoch`)."""

        if self.sched is not None and not steps_per_batch(self.cfg):
            self.sched.step()

    @property
    def lr(self) -> float:
        return float(self.opt.param_groups[0]["lr"])


@torch.no_grad()
def _write_member(m: Member, g: int, params: dict[str, torch.Tensor], states: dict[str, dict], hyper: dict[str, Any],
                  sched_state: dict | None) -> None:
    """Copy slice `g` of stacked weights and optimizer states (and the shared lr and schedule) into member
    `m`'s own model, optimizer and schedule."""
    own = dict(m.model.named_parameters())
    for n, stacked in params.items():
        own[n].copy_(stacked[g])
        st = states.get(n) or {}
        if not st:
            m.opt.state.pop(own[n], None)
            continue
        m.opt.state[own[n]] = {k: (v[g].clone() if isinstance(v, torch.Tensor) and v.dim() > 0
                                   and v.shape == stacked.shape else v.clone() if isinstance(v, torch.Tensor) else v)
                               for k, v in st.items()}
    m.opt.param_groups[0].update(hyper)
    if m.sched is not None and sched_state is not None:
        m.sched.load_state_dict(sched_state)


# ---------------------------------------------------------------- training a group of runs on disk


def _share_dataset(ds: Any, pool: list[torch.Tensor]) -> None:
    """Replace ds's tensors by equal ones already in `pool` (so G runs on one subset hold one copy)."""
    for attr in ("x_train", "x_test", "y_test", "y_train_clean"):
        t = getattr(ds, attr)
        for other in pool:
            if other.shape == t.shape and other.dtype == t.dtype and torch.equal(other, t):
                setattr(ds, attr, other)
                break
        else:
            pool.append(t)


def train_group(runs: list[tuple[str, RunConfig]], exp_dir: str | Path, device: torch.device, *,
                sweep_axes: tuple = (), progress: bool = True, echo: Echo = print) -> TrainOutcome:
    """Train (or resume) the runs of one planned group at once; returns run ids by outcome
    (`trained`, `skipped`: finished meanwhile, `locked`: held by another job).

    Every run gets its lock, run.json (status running, then finished), per-epoch checkpoint.pt and
    model.pt exactly as `train.train_run` writes them. A stop signal marks the unfinished runs
    `preempted` and raises `Preempted` after the last epoch checkpoints.
    """

    device = torch.device(device)
    outcome = TrainOutcome()
    with contextlib.ExitStack() as stack:
        stop = stack.enter_context(StopFlag())
        members: list[Member] = []
        pool: list[torch.Tensor] = []
        for rid, cfg in runs:
            path = run_dir(exp_dir, rid)
            if check_run_dir(path, rid, cfg) == "finished":
                outcome.skipped.append(rid)
                continue
            try:
                stack.enter_context(RunLock(path))
            except RunLocked as exc:
                echo(f"skipping {rid}: {exc}")
                outcome.locked.append(rid)
                continue
            if check_run_dir(path, rid, cfg) == "finished":
                outcome.skipped.append(rid)
                continue
            ds = load_dataset(cfg.data, cfg.data_seed, device=device)
            _share_dataset(ds, pool)
            model, opt, sched, start_epoch, history = restore_run(rid, cfg, path, ds, device)
            members.append(Member(rid, cfg, ds, model, opt, sched, start_epoch, history, path))
        by_start: dict[int, list[Member]] = {}
        for m in members:
            by_start.setdefault(m.start_epoch, []).append(m)
        for m in members:
            m.info = start_info(m.run_id, m.cfg, m.ds, device, sweep_axes, m.history)
            m.info["vectorized_group"] = len(by_start[m.start_epoch])
            atomic_write_json(m.path / RUN_JSON, m.info)
        pending = list(members)
        try:
            for start in sorted(by_start):
                bucket = by_start[start]
                failed = _train_bucket(bucket, device, stop, progress=progress, echo=echo)
                outcome.failed.extend(failed)
                outcome.trained.extend(m.run_id for m in bucket if m.run_id not in failed)
                pending = [m for m in pending if m not in bucket]
        except BaseException as exc:
            if isinstance(exc, (Preempted, KeyboardInterrupt)):
                status = "preempted" if isinstance(exc, Preempted) else "interrupted"
                for m in pending:
                    if m.info.get("status") != "finished":
                        m.info.update(status=status, history=m.history, epochs=len(m.history))
                        atomic_write_json(m.path / RUN_JSON, m.info)
            raise
    return outcome


def _train_bucket(members: list[Member], device: torch.device, stop: Any, *, progress: bool, echo: Echo
                  ) -> list[str]:
    """Train members that start at the same epoch to their end, finishing each when it is done; returns the
    runs that failed (a training loss that became NaN or infinite: marked failed, the others go on).

    The endpoint, evaluation and snapshots are `flatbench.training.endpoint`'s (`reached_endpoint`, `epoch_record`,
    `save_snapshots`), applied to each member's own model after the group's weights are written back."""

    cfg = members[0].cfg
    epoch = members[0].start_epoch
    prior = {m.run_id: sum(h.get("seconds", 0.0) for h in m.history) for m in members}
    t0 = time.perf_counter()

    def finish(m: Member) -> None:
        finish_run(m.run_id, m.cfg, m.path, m.model, m.ds, m.info, m.history, len(m.history),
                   prior[m.run_id] + time.perf_counter() - t0, progress=progress, echo=echo, seek=m.seek)

    active = []
    for m in members:
        if reached_endpoint(m.cfg, m.history):
            finish(m)
        else:
            active.append(m)
    if epoch >= cfg.train.epochs or not active:
        for m in active:
            finish(m)
        return []
    failed: list[str] = []
    group = VectorizedGroup(active, device)
    bar = None
    if progress:
        bar = tqdm(total=cfg.train.epochs, initial=epoch, leave=False, dynamic_ncols=True, unit="ep",
                   desc=f"{len(active)} runs at once ({active[0].run_id}, ...)")
    for m in active:
        m.last_check = m.history[-1].get("eval_train_loss") if m.history else None
    try:
        while epoch < cfg.train.epochs and group.members:
            e0 = time.perf_counter()
            start = group.capture() if step_endpoint(cfg) is not None else None  # to replay a crossing epoch
            stats = group.train_epoch(epoch, stop)
            group.step_schedule()
            epoch += 1
            group.write_back()
            seconds = time.perf_counter() - e0
            stats = _drop_diverged(group, stats, epoch, failed, echo)
            if not group.members:
                break
            crossing = _record_epoch(group, stats, epoch, seconds)
            if start is not None:
                _seek_crossed(group, start, crossing, epoch, stop, seconds)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(progress_fields(group.members[0].history[-1]))
            _finish_reached(group, finish)
    finally:
        if bar is not None:
            bar.close()
    for m in group.members:
        finish(m)
    return failed


def _drop_diverged(group: VectorizedGroup, stats: list[tuple[float, float]], epoch: int, failed: list[str],
                   echo: Echo) -> list[tuple[float, float]]:
    """Mark the members whose training loss became NaN or infinite failed (run.json, one line, `failed`)
    and take them out of the group; returns the stats of the members that remain."""
    diverged = [i for i, (loss, _) in enumerate(stats) if not math.isfinite(loss)]
    for i in diverged:
        m = group.members[i]
        try:
            check_finite_loss(stats[i][0], epoch)
        except TrainingDiverged as exc:
            m.info.update(status="failed", error=f"{type(exc).__name__}: {exc}", history=m.history,
                          epochs=len(m.history))
            atomic_write_json(m.path / RUN_JSON, m.info)
            echo(f"run {m.run_id} failed: {type(exc).__name__}: {exc}")
            failed.append(m.run_id)
    if not diverged:
        return stats
    keep = [i for i in range(len(group.members)) if i not in diverged]
    if keep:
        group.keep(keep)
    else:
        group.members = []
    return [stats[i] for i in keep]


def _record_epoch(group: VectorizedGroup, stats: list[tuple[float, float]], epoch: int, seconds: float
                  ) -> list[Member]:
    """Each member's history entry, snapshots and epoch checkpoint, as `loop.train_run` writes them; returns
    the members whose epoch ended at or below a step-level endpoint's target: they get their entry when the
    step is found (`_seek_crossed`)."""
    crossing = []
    for m, (loss, acc) in zip(group.members, stats):
        train_eval = end_check(m.model, m.ds, m.cfg, epoch, loss, m.history)
        if crossed(m.cfg, train_eval):
            crossing.append(m)
        else:
            _append_epoch(m, EpochStats(loss, acc), epoch, group.lr, seconds, train_eval)
    return crossing


def _append_epoch(m: Member, stats: EpochStats, epoch: int, lr: float, seconds: float,
                  train_eval: tuple[float, float] | None) -> None:
    m.history.append(epoch_record(m.model, m.ds, m.cfg, epoch, stats, lr, seconds, m.history, train_eval))
    m.last_check = train_eval[0] if train_eval is not None else None
    save_snapshots(m.model, m.cfg, m.path, m.history, m.ds)
    if epoch % m.cfg.train.checkpoint_every == 0:
        write_checkpoint(m.path / CHECKPOINT_FILE, m.model, m.opt, m.sched, epoch, m.history, m.cfg.config_hash())


def _seek_crossed(group: VectorizedGroup, start: dict[str, Any], crossing: list[Member], epoch: int, stop: Any,
                  seconds: float) -> None:
    """Each member whose training-set loss crossed its target in `epoch` (1-based) is put back at the epoch's
    start (`start`, the group captured then) and replays the epoch alone (`crossing.seek_crossing`, its own
    model: the group's weights up to float rounding) to the step at which it stops; `_finish_reached` then
    finishes it. A replay that ends above the target (float rounding made the alone epoch differ from the
    group's) goes on in the group from the replayed weights, its epoch recorded as any other."""
    for m in crossing:
        e0 = time.perf_counter()
        group.restore_member(start, m)
        found = seek_crossing(m.model, m.opt, m.sched, m.ds, m.cfg, epoch - 1, stop, m.model, m.last_check)
        took = seconds + time.perf_counter() - e0
        if found.crossed:
            record_stop(found, m.model, m.ds, m.cfg, epoch, float(m.opt.param_groups[0]["lr"]), took, m.history)
            save_snapshots(m.model, m.cfg, m.path, m.history, m.ds)
            m.seek = found.seek_info()
        else:
            group.load_member(m)
            train_eval = end_check(m.model, m.ds, m.cfg, epoch, found.stats.loss, m.history)
            _append_epoch(m, found.stats, epoch, group.lr, took, train_eval)


def _finish_reached(group: VectorizedGroup, finish: Callable[[Member], None]) -> None:
    """Finish the members that reached their endpoint this epoch and re-stack the group without them."""
    finished = [i for i, m in enumerate(group.members) if reached_endpoint(m.cfg, m.history)]
    if not finished:
        return
    for i in finished:
        finish(group.members[i])
    keep = [i for i in range(len(group.members)) if i not in finished]
    if keep:
        group.keep(keep)
    else:
        group.members = []
