"""The stages of a study, each in its own module; the CLI and cluster tasks call them.

    spec.py      a study read from a config or an experiment folder (the one reader of study.yaml), checked
                 before any work, sliced into shards
    train.py     train every unfinished run (one by one or in vectorized groups)
    measure.py   compute the measures on every finished run's final model and snapshots
    report.py    which runs a report covers, with which settings; reads them once (records, tables), then
                 `analysis.report.write_report`
    audit.py     the invariance experiment on one run: measures under random function-preserving rescalings
    population.py  the same over a whole experiment: does each measure keep its τ with the gap?
    compare.py   one page over several studies (`flatbench compare`)
    status.py    how far a study is, from its folder alone
    cluster.py   the same stages as Slurm (or local) job arrays through submitit

Imports go one way: cli → study → measures / analysis → training, curvature, rescale → config, data, models,
losses, store (tests/test_structure.py checks it).
"""
