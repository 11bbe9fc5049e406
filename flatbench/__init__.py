"""flatbench: does a flatness measure track generalization, and does it survive reparametrization?

The package trains models on partly random labels, computes every registered flatness measure on each
trained model and reports how well each measure ranks the models by their generalization gap.
"""

__version__ = "0.1.0"
