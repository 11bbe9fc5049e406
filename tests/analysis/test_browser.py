"""The HTML pages in a real browser: Debian's Chromium, driven by Selenium through chromedriver.

A report over two pooled experiment folders and a comparison page are opened from file:// and checked as
a reader's browser shows them: every image loads, the console logs no error, no request leaves the page
(every request the browser makes is file: or data:), clicking a column header reorders the verdict table,
the filters hide rows, the pointer over a scatter point shows that point's run id, and with scripts off
the tables and images are still there.

The committed reports and the comparison page (issue 28) are opened at 1440×900 in one browser session:
the verdict block's columns on the first screen, the floor and ceiling rows, no table wider than the
window, the comparison page's heatmap first and its table's scroll width within 1440 px, a design figure
per swept axis that the page's select shows, training curves from epoch 1; printed (A4, Chromium's
printToPDF), every collapsed section open and tsuzuku_mnist's report within its page budget.

Chromium and chromedriver come from Debian's `chromium` and `chromium-driver` packages (`.ci/run` installs
them). Without them the tests are skipped locally and fail in CI (where `CI` is set), so that CI never
passes without having opened the pages.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from test_report import write_experiment

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--window-size=1280,1000")


def _missing() -> str:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    for path in (CHROMIUM, CHROMEDRIVER):
        if not Path(path).exists():
            return f"{path} is missing (apt-get install chromium chromium-driver)"
    return ""


@pytest.fixture(scope="module")
def browser_factory():
    """Start headless Chromium sessions (fresh profile each); skip locally, fail in CI, when absent."""
    why = _missing()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"the browser tests must run in CI: {why}")
        pytest.skip(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    drivers, profiles = [], []

    def start(scripts: bool = True):
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        profiles.append(tempfile.mkdtemp(prefix="fb-chromium-"))
        for flag in (*FLAGS, f"--user-data-dir={profiles[-1]}"):
            options.add_argument(flag)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
        if not scripts:
            options.add_experimental_option("prefs", {"profile.managed_default_content_settings.javascript": 2})
        drivers.append(webdriver.Chrome(service=Service(CHROMEDRIVER), options=options))
        return drivers[-1]

    yield start
    for driver in drivers:
        driver.quit()
    for profile in profiles:
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    """A report over two pooled folders (16 runs: intervals, comparisons, τ per model) and a comparison page."""
    from flatbench.analysis.compare import write_comparison
    from flatbench.analysis.report import write_report

    root = tmp_path_factory.mktemp("pages")
    a = write_experiment(root, "mlps", seed=1)
    b = write_experiment(root, "lenets", model="lenet", seed=2)
    for exp in (a, b):
        write_report([exp], exp, n_boot=100, echo=lambda _: None)
    pooled = root / "pooled"
    summary = write_report([a, b], pooled, n_boot=100, echo=lambda _: None)
    write_comparison([a, b], root / "comparison")
    return {"report": pooled / "report.html", "comparison": root / "comparison" / "comparison.html",
            "runs": sorted(summary.table["run_id"])}


def _open(driver, page: Path) -> None:
    driver.get(page.resolve().as_uri())
    driver.execute_script("return document.readyState")


def _check_loads_offline(driver, page: Path) -> None:
    """Every image decoded, no console error, every request file: or data:."""
    driver.get("about:blank")
    driver.get_log("performance")  # drop the browser's own start-up requests (its new-tab page)
    driver.get_log("browser")
    _open(driver, page)
    images = driver.execute_script(
        "return Array.from(document.images).map(i => [i.complete, i.naturalWidth, i.alt]);")
    assert images and all(done and width > 0 for done, width, _ in images), images
    errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
    assert not errors, errors
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message.get("method") == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    resources = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name);")
    assert urls, "the performance log recorded no request at all (not even the page)"
    assert all(u.startswith(("file:", "data:")) for u in urls + resources), [u[:80] for u in urls + resources]


def _column(driver, table_id: str, col: int) -> list[str]:
    return driver.execute_script(
        f"return Array.from(document.querySelectorAll('#{table_id} tbody tr'))"
        f".filter(r => !r.hidden).map(r => r.cells[{col}].textContent.trim());")


def _number(text: str) -> float:
    try:
        return float(text.split()[0].replace("−", "-").lstrip("<"))
    except (ValueError, IndexError):
        return math.nan


def test_report_in_a_browser(browser_factory, pages):
    from selenium.webdriver.common.by import By

    driver = browser_factory()
    _check_loads_offline(driver, pages["report"])
    headers = driver.find_elements(By.CSS_SELECTOR, "#verdict thead th")
    names = [h.text for h in headers]
    tau_col = next(i for i, name in enumerate(names) if name.startswith("Kendall τ"))
    measure_col = names.index("measure")
    before = _column(driver, "verdict", measure_col)
    headers[measure_col].click()
    after = _column(driver, "verdict", measure_col)
    assert after != before and after == sorted(after)
    headers[tau_col].click()  # numbers: largest first
    taus = [_number(t) for t in _column(driver, "verdict", tau_col)]
    assert taus == sorted(taus, reverse=True) and _column(driver, "verdict", measure_col) != after
    select = driver.find_element(By.CSS_SELECTOR, ".filters select[name=invariance]")
    options = [o.get_attribute("value") for o in select.find_elements(By.TAG_NAME, "option")]
    assert "" in options and len(options) > 1
    total = len(_column(driver, "verdict", 0))
    select.find_elements(By.TAG_NAME, "option")[1].click()
    assert 0 < len(_column(driver, "verdict", 0)) < total or len(options) == 2


def test_the_verdict_tables_audit_cells_are_one_line(browser_factory, tmp_path):
    """The audit column's cells ("layer: breaks 0.2; node: breaks 0.2") are laid out on one line at 1440 px,
    the width of the committed reports' first screen: the text of each cell has one line box."""
    import pandas as pd
    from selenium.webdriver.common.by import By

    from flatbench.analysis.report import write_report
    from test_report import _audit_csv

    exp = write_experiment(tmp_path, "audited")
    for folder, family in (("audit_draws", "node"), ("audit_layer", "layer")):
        (exp / folder).mkdir()
        _audit_csv(exp / folder / "audit_correlations.csv")
        frame = pd.read_csv(exp / folder / "audit_correlations.csv")
        frame.assign(family=family).to_csv(exp / folder / "audit_correlations.csv", index=False)
    write_report([exp], exp, n_boot=50, echo=lambda _: None)
    driver = browser_factory()
    driver.set_window_size(1440, 900)
    _open(driver, exp / "report.html")
    lines = driver.execute_script(
        "return Array.from(document.querySelectorAll('#verdict tbody td.nowrap')).map(td => {"
        "  const r = document.createRange(); r.selectNodeContents(td);"
        "  const tops = new Set(Array.from(r.getClientRects()).map(b => Math.round(b.top)));"
        "  return [td.textContent, tops.size, getComputedStyle(td).whiteSpace]; });")
    assert any("layer: breaks 0.2; node: breaks 0.2" == text for text, _, _ in lines)
    assert lines and all(n == 1 and ws == "nowrap" for _, n, ws in lines), lines


def _isolated_point(points: list[list[float]]) -> list[float]:
    """A point whose nearest neighbour is more than 12 px away (so the hover can only mean it)."""
    for p in points:
        if all((p[0] - q[0]) ** 2 + (p[1] - q[1]) ** 2 > 144 for q in points if q is not p):
            return p
    raise AssertionError("no isolated point to hover")


def test_hover_shows_the_run(browser_factory, pages):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    driver = browser_factory()
    _open(driver, pages["report"])
    figure = driver.find_element(By.CSS_SELECTOR, "figure.hover")
    spec = json.loads(driver.find_element(By.ID, figure.get_attribute("id") + "-points").get_attribute("textContent"))
    runs = json.loads(driver.find_element(By.ID, "fb-data").get_attribute("textContent"))["runs"]
    image = figure.find_element(By.TAG_NAME, "img")
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", image)
    x, y, run, _, _ = _isolated_point(spec["points"])
    width, natural = image.size["width"], driver.execute_script("return arguments[0].naturalWidth;", image)
    scale = width / natural
    ActionChains(driver).move_to_element_with_offset(image, x * scale - width / 2,
                                                     y * scale - image.size["height"] / 2).perform()
    tip = driver.find_element(By.ID, "fb-tip")
    assert tip.is_displayed()
    assert tip.get_attribute("data-run") == runs[run]["id"] and runs[run]["id"] in tip.text
    assert runs[run]["id"] in pages["runs"] and "data.random_label_ratio" in tip.text


def test_report_without_scripts_keeps_tables_and_images(browser_factory, pages):
    from selenium.webdriver.common.by import By

    driver = browser_factory(scripts=False)
    _open(driver, pages["report"])
    assert not driver.find_elements(By.CSS_SELECTOR, ".filters")  # the script did not run
    assert len(driver.find_elements(By.CSS_SELECTOR, "#verdict tbody tr")) > 3
    assert driver.execute_script("return Array.from(document.images).every(i => i.complete && i.naturalWidth > 0);")


def test_comparison_in_a_browser(browser_factory, pages):
    from selenium.webdriver.common.by import By

    driver = browser_factory()
    _check_loads_offline(driver, pages["comparison"])
    headers = driver.find_elements(By.CSS_SELECTOR, "#comparison thead th")
    before = _column(driver, "comparison", 0)
    headers[0].click()
    names = _column(driver, "comparison", 0)
    assert names != before and names == sorted(names)
    headers[2].click()
    values = [_number(t) for t in _column(driver, "comparison", 2)]
    finite = [v for v in values if not math.isnan(v)]
    assert finite == sorted(finite, reverse=True) and _column(driver, "comparison", 0) != names


COMMITTED = Path(__file__).resolve().parents[2] / "results" / "cpu"
STUDIES = ("hyperparameters", "tsuzuku_mnist", "tsuzuku_cifar10", "ibayashi_mnist", "yi_mnist")
REPORTS = (*STUDIES, "natural", "natural/gap_acc")
VERDICT_COLUMNS = ("Kendall τ within draws [95% CI]", "vs best (Holm p)", "τ pooled / within cell",
                   "vs baseline: Δτ", "Ψ", "CMI", "sign error mean", "sign error worst",
                   "audit: largest |Δτ|")
PAGE_BUDGET = {"tsuzuku_mnist": 12}
"""A4 pages the committed report may print to, every collapsed section open (issue 28)."""


def _first_screen(driver, page: Path) -> None:
    """A 1440×900 window at the top of the page."""
    driver.set_window_size(1440, 900)
    _open(driver, page)
    driver.execute_script("window.scrollTo(0, 0);")


def _verdict_on_first_screen(driver) -> list[str]:
    """The verdict table's header texts, after checking that the design sentence, the headline and the
    header row are inside the first screen."""
    height = driver.execute_script("return window.innerHeight;")
    tops = driver.execute_script(
        "return ['p.design', 'p.headline', '#verdict thead'].map(s => document.querySelector(s))"
        ".map(e => e ? e.getBoundingClientRect().bottom : null);")
    assert all(t is not None and 0 < t <= height for t in tops), (tops, height)
    return driver.execute_script("return Array.from(document.querySelectorAll('#verdict thead th'))"
                                 ".map(h => h.textContent.trim());")


@pytest.fixture(scope="module")
def reader(browser_factory):
    """One browser for the committed pages (a session per page would double the tests' time)."""
    return browser_factory()


def _axes(study: str) -> list[str]:
    """The study's swept axes, as its correlations.csv names them (a ψ column per axis)."""
    columns = (COMMITTED / study / "correlations.csv").read_text(encoding="utf-8").splitlines()[0].split(",")
    return [c[len("psi_"):] for c in columns if c.startswith("psi_") and c != "psi_data"]


@pytest.mark.parametrize("study", REPORTS)
def test_a_committed_report_puts_the_verdict_first(reader, study):
    """Issue 28: the design sentence, and the verdict table with τ, vs best, Ψ, ψ per swept axis, CMI, sign
    errors and the audit, on the first screen at 1440×900; the floor and ceiling rows below it; each ψ of
    the strip coloured; no table wider than the window."""
    driver = reader
    page = COMMITTED / study / "report.html"
    _first_screen(driver, page)
    headers = _verdict_on_first_screen(driver)
    for column in VERDICT_COLUMNS:
        assert column in headers, (column, headers)
    psi = [h for h in headers if h.startswith("ψ ")]
    axes = _axes(study)
    assert len(psi) == len(axes) >= 1, (psi, axes)
    refs = driver.execute_script(
        "return Array.from(document.querySelectorAll('#verdict tfoot tr')).map(r => r.cells[1].textContent.trim());")
    assert refs[0] == "ref.hyperparameters" and refs[-2:] == ["ref.random", "ref.replicate_gap"], refs
    assert sorted(refs[1:-2]) == sorted(f"ref.axis.{a}" for a in axes), refs
    colored = driver.execute_script(
        "var i = Array.from(document.querySelectorAll('#verdict thead th')).findIndex(h => h.textContent.startsWith('ψ '));"
        "return Array.from(document.querySelectorAll('#verdict tbody tr')).filter(r => r.cells[i].style.background).length;")
    assert colored >= 1
    width = driver.execute_script("return Math.max(...Array.from(document.querySelectorAll('table')).map(t => t.scrollWidth));")
    assert width <= 1440, width


def test_the_committed_comparison_compares(reader):
    """Issue 28: the heatmap on the first screen, a row per study (n, dataset, model, swept axes), and one
    compact table whose scroll width fits 1440 px and that sorts every study's column by number."""
    from selenium.webdriver.common.by import By

    driver = reader
    page = COMMITTED / "comparison" / "comparison.html"
    _first_screen(driver, page)
    height = driver.execute_script("return window.innerHeight;")
    top = driver.execute_script("return document.querySelector('figure img').getBoundingClientRect().top;")
    assert 0 < top < height
    studies = driver.execute_script("return Array.from(document.querySelectorAll('#studies thead th'))"
                                    ".map(h => h.textContent.trim());")
    assert {"study", "n runs", "dataset", "model", "swept axes"} <= set(studies)
    assert len(_column(driver, "studies", 0)) == 6
    width = driver.execute_script("return document.getElementById('comparison').scrollWidth;")
    assert width <= 1440, width
    headers = driver.find_elements(By.CSS_SELECTOR, "#comparison thead th")
    for col in range(2, len(headers)):
        headers[col].click()
        values = [_number(t) for t in _column(driver, "comparison", col)]
        finite = [v for v in values if not math.isnan(v)]
        assert finite == sorted(finite, reverse=True), col
        assert all(math.isnan(v) for v in values[len(finite):]), col  # words ("–", "no τ") last


def _print_pdf(driver, page: Path) -> bytes:
    import base64

    _open(driver, page)
    pdf = driver.execute_cdp_cmd("Page.printToPDF", {"paperWidth": 8.27, "paperHeight": 11.69,
                                                      "preferCSSPageSize": True, "printBackground": True})
    return base64.b64decode(pdf["data"])


def _pages(pdf: bytes) -> int:
    import re

    return len(re.findall(rb"/Type\s*/Page(?![a-zA-Z])", pdf))


@pytest.mark.parametrize("study", ["tsuzuku_mnist", "comparison"])
def test_a_committed_page_prints_everything_within_its_budget(reader, study):
    """Issue 28: printed, every collapsed section is open (its content laid out), and tsuzuku_mnist's report
    fits its A4 page budget; the comparison page prints every study's column (no table wider than A4)."""
    driver = reader
    page = COMMITTED / study / ("comparison.html" if study == "comparison" else "report.html")
    _open(driver, page)
    driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {"media": "print"})
    driver.set_window_size(760, 1100)  # about A4's printable width at 96 px per inch
    hidden = driver.execute_script(
        "return Array.from(document.querySelectorAll('details')).filter(d => Array.from(d.children)"
        ".some(c => c.tagName !== 'SUMMARY' && c.getClientRects().length === 0)).length;")
    assert hidden == 0
    if study == "comparison":
        wide = driver.execute_script("return Array.from(document.querySelectorAll('table'))"
                                     ".filter(t => t.scrollWidth > document.body.clientWidth + 1).length;")
        assert wide == 0
    driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {"media": ""})
    pages = _pages(_print_pdf(driver, page))
    assert 1 <= pages <= PAGE_BUDGET.get(study, 6), pages


@pytest.mark.parametrize("study", STUDIES)
def test_a_committed_report_in_a_browser(reader, study):
    """The committed reports as a reader opens them: every image loads, nothing is fetched, no console error,
    and each of the verdict table's filters (family, cost, invariance) keeps some rows and hides others."""
    from selenium.webdriver.common.by import By

    page = COMMITTED / study / "report.html"
    assert page.is_file(), f"{page} is committed with the study"
    driver = reader
    driver.set_window_size(1280, 1000)
    _check_loads_offline(driver, page)
    total = len(_column(driver, "verdict", 0))
    assert total >= 10
    for name in ("family", "cost", "invariance"):
        select = driver.find_element(By.CSS_SELECTOR, f".filters select[name={name}]")
        options = select.find_elements(By.TAG_NAME, "option")
        assert options[0].get_attribute("value") == "" and len(options) > 2, name
        options[1].click()
        shown = len(_column(driver, "verdict", 0))
        assert 0 < shown < total, (name, options[1].get_attribute("value"), shown, total)
        options[0].click()
        assert len(_column(driver, "verdict", 0)) == total


def test_the_committed_comparison_in_a_browser(reader):
    page = COMMITTED / "comparison" / "comparison.html"
    assert page.is_file(), f"{page} is committed with the studies"
    driver = reader
    _check_loads_offline(driver, page)
    assert len(_column(driver, "comparison", 0)) >= 10


@pytest.mark.parametrize("study", REPORTS)
def test_a_committed_report_facets_every_axis_and_curves_start_at_epoch_1(reader, study):
    """Issue 28, the figures' data: a design figure per swept axis, each one the page's select can show
    (the others hidden, their image loaded), every point of it a run of the hover data; the training
    curves start at epoch 1 and draw the loss target."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    driver = reader
    driver.set_window_size(1440, 900)
    _open(driver, COMMITTED / study / "report.html")
    axes = _axes(study)
    facets = driver.execute_script("return Array.from(document.querySelectorAll('figure.facet'))"
                                   ".map(f => f.getAttribute('data-facet'));")
    assert sorted(facets) == sorted(axes), (facets, axes)
    data = json.loads(driver.find_element(By.ID, "fb-data").get_attribute("textContent"))
    for fig in driver.find_elements(By.CSS_SELECTOR, "figure.facet"):
        spec = json.loads(driver.find_element(By.ID, fig.get_attribute("id") + "-points").get_attribute("textContent"))
        assert spec["points"] and all(0 <= p[2] < len(data["runs"]) for p in spec["points"])
    if len(axes) > 1:
        select = Select(driver.find_element(By.CSS_SELECTOR, "select[name=facet]"))
        assert sorted(o.get_attribute("value") for o in select.options) == sorted(axes)
        for axis in axes:
            select.select_by_value(axis)
            shown = driver.execute_script(
                "return Array.from(document.querySelectorAll('figure.facet')).filter(f => f.offsetParent !== null)"
                ".map(f => [f.getAttribute('data-facet'), f.querySelector('img').naturalWidth]);")
            assert len(shown) == 1 and shown[0][0] == axis and shown[0][1] > 0, (axis, shown)
    curves = data["figures"]["training_curves.png"]
    assert curves["first_epoch"] == 1 and curves["runs"] >= 10
    assert curves["target_train_loss"] is not None
