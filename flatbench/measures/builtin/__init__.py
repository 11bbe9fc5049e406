"""The built-in measures: one module per family, each registering its measures with
`flatbench.measures.plugin.register_measure` exactly as an outside plugin does, with the family the report
groups it in and the papers behind it. Every module of this package is imported when the registry is first
read. The citations several modules name are written here once."""

JIANG = ("Jiang, Neyshabur, Mobahi, Krishnan, Bengio. Fantastic generalization measures and where to find them. "
         "ICLR 2020")
TSUZUKU = ("Tsuzuku, Sato, Sugiyama. Normalized flat minima: exploring scale invariant definition of flat "
           "minima for neural networks using PAC-Bayesian analysis. ICML 2020")
ADAPTIVE = ("Kwon, Kim, Park, Choi. ASAM: adaptive sharpness-aware minimization. ICML 2021; Andriushchenko, "
            "Croce, Müller, Hein, Flammarion. A modern look at the relationship between sharpness and "
            "generalization. ICML 2023")
