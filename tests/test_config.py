"""Config parsing, validation errors, overrides, sweep expansion and run ids."""

from __future__ import annotations

import pytest

from flatbench.config import apply_overrides, load_study, parse_study
from flatbench.errors import ConfigError


def test_defaults_and_single_run():
    study = parse_study({"data": {"random_label_ratio": 0.3}}, default_name="x")
    assert len(study.runs) == 1
    rid, run = study.runs[0]
    assert rid.startswith("mlp-mnist_mini-r0.30-s0-") and len(rid.rsplit("-", 1)[1]) == 8
    assert run.model.widths == (512, 512) and run.train.optimizer == "adam"
    assert study.exp_dir.as_posix() == "results/x"


def test_sweep_is_cartesian_product_with_stable_ids():
    raw = {"seed": [0, 1], "data": {"random_label_ratio": [0.0, 0.5, 1.0]},
           "train": {"lr": [0.001, 0.01]}}
    study = parse_study(raw)
    assert len(study.runs) == 12
    ids = study.run_ids()
    assert len(set(ids)) == 12
    # an id depends on the run's full config, not on the sweep it came from
    alone = parse_study({"seed": 1, "data": {"random_label_ratio": 0.5}, "train": {"lr": 0.01}})
    assert alone.run_ids()[0] in ids
    assert set(study.sweep_axes) == {"seed", "data.random_label_ratio", "train.lr"}
    assert parse_study(raw).run_ids() == ids  # stable


def test_list_typed_field_sweeps_only_with_list_of_lists():
    single = parse_study({"model": {"widths": [64, 32]}})
    assert len(single.runs) == 1 and single.runs[0][1].model.widths == (64, 32)
    swept = parse_study({"model": {"widths": [[64], [128, 128]]}})
    assert [r.model.widths for _, r in swept.runs] == [(64,), (128, 128)]
    assert swept.run_ids()[1] == parse_study({"model": {"widths": [128, 128]}}).run_ids()[0]


def test_uniform_ratios_are_drawn_from_the_seed():
    a = parse_study({"seed": 3, "data": {"random_label_ratio": {"uniform": 6}}})
    b = parse_study({"seed": 3, "data": {"random_label_ratio": {"uniform": 6}}})
    c = parse_study({"seed": 4, "data": {"random_label_ratio": {"uniform": 6}}})
    ratios = [r.data.random_label_ratio for _, r in a.runs]
    assert len(ratios) == 6 and all(0 <= r <= 1 for r in ratios)
    assert ratios == [r.data.random_label_ratio for _, r in b.runs]
    assert ratios != [r.data.random_label_ratio for _, r in c.runs]


@pytest.mark.parametrize("raw, fragment", [
    ({"trian": {}}, "unknown key 'trian'"),
    ({"train": {"epoch": 3}}, "valid keys in 'train'"),
    ({"train": {"epochs": "many"}}, "train.epochs: expected an integer"),
    ({"train": {"lr": "fast"}}, "train.lr: expected a number"),
    ({"data": {"random_label_ratio": 1.5}}, "must be in [0, 1]"),
    ({"data": {"random_label_ratio": [0.5, -0.1]}}, "must be in [0, 1]"),
    ({"train": {"eval_every": 0}}, "train.eval_every must be positive"),
    ({"train": {"target_train_loss": 0}}, "train.target_train_loss must be positive"),
    ({"train": {"snapshot_losses": [0.1, -1]}}, "train.snapshot_losses must be positive"),
    ({"train": {"schedule": "inverse"}}, "did you mean 'inverse_time'"),
    ({"train": {"lr_decay": -1}}, "train.lr_decay must be non-negative"),
    ({"report": {"min_train_acc": 2}}, "report.min_train_acc must be in [0, 1]"),
    ({"trian": {}}, "did you mean 'train'"),
    ({"train": {"epoch": 3}}, "did you mean 'epochs'"),
    ({"train": {"optimizer": "lion"}}, "train.optimizer: unknown value 'lion'"),
    ({"model": {"bias": "yes"}}, "expected true or false"),
    ({"measure": {"losses": ["mae"]}}, "unknown loss 'mae'"),
    ({"model": {"name": "wrn", "depth": 15}}, "6k+4"),
    ({"train": {"epochs": 0}}, "must be positive"),
    ({"train": {"endpoint_tolerance": 0.05}}, "train.endpoint_tolerance needs train.target_train_loss"),
    ({"train": {"target_train_loss": 0.01, "endpoint_tolerance": 1.0}}, "train.endpoint_tolerance must be in (0, 1)"),
    ({"train": {"target_train_loss": 0.01, "endpoint_tolerance": 0}}, "train.endpoint_tolerance must be in (0, 1)"),
    ({"train": {"target_train_loss": 0.01, "target_train_acc": 0.9, "endpoint_tolerance": 0.05}},
     "applies to train.target_train_loss alone"),
    ({"train": {"target_train_loss": 0.01, "endpoint_tolerance": 0.05, "endpoint_check_steps": 0}},
     "train.endpoint_check_steps must be at least 1"),
    ({"train": {"target_train_loss": 0.01, "endpoint_check_steps": 4}}, "has no effect without train.endpoint_tolerance"),
    ({"train": {"target_train_loss": 0.01, "endpoint_scale_step": False}}, "has no effect without"),
])
def test_validation_errors_are_one_clear_line(raw, fragment):
    with pytest.raises(ConfigError) as info:
        parse_study(raw)
    message = str(info.value)
    assert fragment in message and "\n" not in message


def test_yaml_style_scientific_notation_is_accepted():
    study = parse_study({"train": {"lr": "1e-3"}})
    assert study.runs[0][1].train.lr == pytest.approx(1e-3)


def test_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  random_label_ratio: 0.5\ntrain:\n  epochs: 4\n")
    study = load_study(path, ["train.epochs=2", "data.random_label_ratio=[0, 1]", "model.widths=[16]"])
    assert [r.train.epochs for _, r in study.runs] == [2, 2]
    assert [r.data.random_label_ratio for _, r in study.runs] == [0.0, 1.0]
    assert study.runs[0][1].model.widths == (16,)
    assert study.name == "c"
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides({}, ["train.epochs"])
    with pytest.raises(ConfigError, match="unknown key 'bogus'"):
        apply_overrides({}, ["bogus.x=1"])


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_study(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [epochs: 3\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_study(bad)


def test_config_hash_ignores_eval_batch_size_only():
    a = parse_study({}).runs[0][1]
    b = parse_study({"train": {"eval_batch_size": 17}}).runs[0][1]
    c = parse_study({"train": {"lr": 0.01}}).runs[0][1]
    assert a.config_hash() == b.config_hash() != c.config_hash()


def test_run_id_formats_floats_exactly():
    study = parse_study({"data": {"random_label_ratio": [0.125, 0.3]}})
    assert [rid.rsplit("-", 1)[0] for rid in study.run_ids()] == ["mlp-mnist_mini-r0.125-s0",
                                                                 "mlp-mnist_mini-r0.30-s0"]
    run = study.runs[0][1]
    assert run.run_id() == study.run_ids()[0]  # an id depends on the full config, not on the sweep


def test_growing_a_study_keeps_its_run_ids():
    """Adding an axis (or a value to one) renames none of the existing runs."""
    base = parse_study({"data": {"random_label_ratio": [0.0, 1.0]}, "model": {"widths": [64]}})
    grown = parse_study({"seed": [0, 1], "data": {"random_label_ratio": [0.0, 0.5, 1.0]},
                         "model": {"widths": [[64], [32]]}, "train": {"lr": [0.001, 0.01]}})
    assert set(base.run_ids()) <= set(grown.run_ids())
    assert len(grown.runs) == 24


def test_run_id_ignores_defaults_given_explicitly_and_execution_keys():
    plain = parse_study({}).run_ids()[0]
    explicit = parse_study({"train": {"lr": 0.001, "optimizer": "adam", "eval_batch_size": 17,
                                      "vectorize": 4, "compile": True}, "data": {"root": "/x"}}).run_ids()[0]
    assert plain == explicit
    assert parse_study({"train": {"lr": 0.01}}).run_ids()[0] != plain


def test_the_step_endpoint_settings_keep_every_existing_run_id():
    """Issue 42: a config without `train.endpoint_tolerance` (every committed study) keeps its run ids, also
    with the endpoint settings' defaults given explicitly; setting the tolerance makes other runs."""
    raw = {"data": {"dataset": "mnist_mini", "n_train": 300, "n_test": 200, "random_label_ratio": 0.0},
           "model": {"name": "mlp", "widths": [32]}, "train": {"epochs": 3, "batch_size": 64, "lr": 0.003}}
    assert parse_study(raw).run_ids() == ["mlp-mnist_mini-r0.00-s0-7dc62239"]  # as in test_planted_bugs
    loss = {**raw, "train": {**raw["train"], "target_train_loss": 0.01}}
    plain = parse_study(loss).run_ids()[0]
    explicit = {**loss, "train": {**loss["train"], "endpoint_tolerance": None, "endpoint_check_steps": 1,
                                  "endpoint_scale_step": True}}
    assert parse_study(explicit).run_ids()[0] == plain
    ids = {parse_study({**loss, "train": {**loss["train"], **extra}}).run_ids()[0]
           for extra in ({"endpoint_tolerance": 0.05}, {"endpoint_tolerance": 0.1},
                         {"endpoint_tolerance": 0.05, "endpoint_check_steps": 4},
                         {"endpoint_tolerance": 0.05, "endpoint_scale_step": False})}
    assert len(ids) == 4 and plain not in ids


def test_identity_diff_names_the_differing_keys():
    from flatbench.config import identity_diff

    a = parse_study({"train": {"lr": 0.01}}).runs[0][1]
    b = parse_study({"train": {"lr": 0.001}, "model": {"widths": [8]}}).runs[0][1]
    diff = identity_diff(a, b)
    assert diff == ["model.widths: stored [512, 512], expected [8]", "train.lr: stored 0.01, expected 0.001"]


def test_empty_config_file_is_refused(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing here\n")
    with pytest.raises(ConfigError, match="is empty"):
        load_study(path)


def test_config_reference_lists_every_key():
    import dataclasses
    from pathlib import Path

    from project_scripts import load_script

    from flatbench.config import SECTIONS

    path = Path(__file__).resolve().parents[1] / "scripts" / "readme_tables.py"
    module = load_script("readme_tables")
    table = module.config_reference()
    page = (path.parents[1] / "docs" / "guide" / "configs.md").read_text()
    assert "<!-- generated: config-reference -->" in page  # the site's build puts the table there
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f"`{section}.{f.name}`" in table, f"{section}.{f.name}"
    for key in ("data.random_label_ratio", "train.target_train_acc", "measure.settings", "report.gap"):
        assert f"`{key}`" in table


def test_every_shipped_config_is_valid():
    from pathlib import Path

    configs = sorted((Path(__file__).resolve().parents[1] / "configs").rglob("*.yaml"))
    assert configs, "no configs found"
    for path in configs:
        study = load_study(path)
        assert study.runs, path
