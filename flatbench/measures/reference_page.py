"""The documentation site's page of one measure, in Markdown, generated from its registry entry.

The measure reference (docs/measures/) must not drift from the code, and a plugin's measure must be
documented as fully as a built-in one without extra work (issue 31). So a page is written from the
`MeasureSpec` alone, by the same pieces as `flatbench describe` (`flatbench.measures.describe`): the
definition (description and docstring), the invariances, the facts (cost, loss, precision, kind), every
setting with its default and its meaning and valid range, the variants, an example, and the papers.

`docs/hooks.py` calls `measure_page` for every registered measure when the site is built, and
`flatbench describe NAME --markdown` prints the same page (for a plugin: with `--plugin`).
"""

from __future__ import annotations

from flatbench.measures.describe import config_value, definition_lines, example_lines, fact_lines, invariance_lines
from flatbench.measures.registry import MeasureSpec, get_measure

JIANG = "Jiang, Neyshabur, Mobahi, Krishnan, Bengio. Fantastic generalization measures and where to find them. ICLR 2020"
TSUZUKU = ("Tsuzuku, Sato, Sugiyama. Normalized flat minima: exploring scale invariant definition of flat "
           "minima for neural networks using PAC-Bayesian analysis. ICML 2020")
ADAPTIVE = ("Kwon, Kim, Park, Choi. ASAM: adaptive sharpness-aware minimization. ICML 2021; Andriushchenko, "
            "Croce, Müller, Hein, Flammarion. A modern look at the relationship between sharpness and "
            "generalization. ICML 2023")
PAPERS: dict[str, tuple[str, ...]] = {
    "adaptive_sharpness_avg": (ADAPTIVE,),
    "adaptive_sharpness_l2": (ADAPTIVE,),
    "adaptive_sharpness_linf": (ADAPTIVE,),
    "eps_sharpness": ("Keskar, Mudigere, Nocedal, Smelyanskiy, Tang. On large-batch training for deep learning: "
                      "generalization gap and sharp minima. ICLR 2017", JIANG),
    "fisher_rao_norm": ("Liang, Poggio, Rakhlin, Stokes. Fisher-Rao metric, geometry, and complexity of neural "
                        "networks. AISTATS 2019", JIANG),
    "frobenius_norm": (JIANG,),
    "frobenius_norm_product": (JIANG,),
    "hessian_density": ("Ghorbani, Krishnan, Xiao. An investigation into neural net optimization via Hessian "
                        "eigenvalue density. ICML 2019",),
    "hessian_max_eig": ("Keskar et al. ICLR 2017 (sharpness as λ_max)", JIANG),
    "hessian_trace": ("Meyer, Musco, Musco, Woodruff. Hutch++: optimal stochastic trace estimation. SOSA 2021",),
    "matrix_normalized_sharpness": (TSUZUKU,),
    "minimum_sharpness": ("Ibayashi, Hamaguchi, Imaizumi. Minimum sharpness: scale-invariant parameter-robustness "
                          "of neural networks. 2021",),
    "normalized_sharpness": (TSUZUKU,),
    "normalized_sharpness_nce": (TSUZUKU,),
    "pacbayes_flatness": (JIANG, "Dziugaite, Drouin, Neal, Rajkumar, Caballero, Wang, Mitliagkas, Roy. In search "
                          "of robust measures of generalization. NeurIPS 2020"),
    "pacbayes_mag_flatness": (JIANG,),
    "path_norm": ("Neyshabur, Tomioka, Srebro. Norm-based capacity control in neural networks. COLT 2015", JIANG),
    "psi_flatness": ("Yi, Meng, Chen, Ma, Liu. Positively scale-invariant flatness of ReLU neural networks. 2019",),
    "psi_path_ratio": ("Yi, Meng, Chen, Ma, Liu. Positively scale-invariant flatness of ReLU neural networks. 2019",),
    "relative_flatness": ("Petzka, Kamp, Adilova, Sminchisescu, Boley. Relative flatness and generalization. "
                          "NeurIPS 2021",),
    "relative_flatness_normalized": ("Petzka, Kamp, Adilova, Sminchisescu, Boley. Relative flatness and "
                                     "generalization. NeurIPS 2021",),
    "scale_invariant_rangamani": ("Rangamani, Nguyen, Kumar, Tran, Tran. A scale invariant flatness measure for deep "
                                  "network minima. 2019",),
    "spectral_norm": ("Bartlett, Foster, Telgarsky. Spectrally-normalized margin bounds for neural networks. "
                      "NeurIPS 2017", JIANG),
}
"""The papers behind each built-in measure (a plugin's page says where it was registered instead)."""


def _settings_table(spec: MeasureSpec) -> list[str]:
    """Every setting as a Markdown table row: name, default, meaning and valid range."""
    if not spec.defaults:
        return ["None."]
    rows = ["| setting | default | meaning and valid range |", "| --- | --- | --- |"]
    for key, default in spec.defaults.items():
        fixed = f" (fixed to `{config_value(spec.preset[key])}` by this variant)" if key in spec.preset else ""
        meaning = spec.settings_help.get(key, "").replace("|", "\\|") or "(no description registered)"
        rows.append(f"| `{key}` | `{config_value(default)}`{fixed} | {meaning} |")
    return rows


def _papers(spec: MeasureSpec) -> list[str]:
    if spec.origin != "builtin":
        return [f"Registered by the plugin `{spec.origin}`."]
    return [f"- {paper}" for paper in PAPERS.get(spec.base_name, ())] or ["flatbench's own baseline."]


def measure_page(name: str) -> str:
    """The Markdown page of measure `name` (a variant `name:variant` too): one section per part of
    `flatbench describe`, with the settings as a table and the papers."""
    spec = get_measure(name)
    definition = definition_lines(spec)
    out = [f"# `{spec.name}`", "", definition[0], ""]
    if len(definition) > 2:  # the docstring: Markdown already (backticks for names, indented blocks for code)
        out += [*definition[2:], ""]
    out += ["## Invariant to", "", *[f"- {line}" for line in invariance_lines(spec)], ""]
    out += ["## Facts", "", *[f"- {line}" for line in fact_lines(spec)], ""]
    out += [f"## Settings (`measure.settings.{spec.base_name}`)", "", *_settings_table(spec), ""]
    if spec.variants:
        out += ["## Variants", ""]
        out += [f"- `{spec.name}:{v}`: " + ", ".join(f"`{k}={config_value(x)}`" for k, x in preset.items())
                for v, preset in spec.variants.items()]
        out.append("")
    out += ["## Example", "", "```text", *example_lines(spec), "```", "", "## Papers", "", *_papers(spec), ""]
    return "\n".join(out)
