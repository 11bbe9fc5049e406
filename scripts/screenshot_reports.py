"""Full-page screenshots of report pages, for a person to look at (every figure, as a reader sees it).

    python scripts/screenshot_reports.py [PAGE.html | EXPERIMENT_DIR ...] [--out DIR] [--width 1280]
                                         [--top PX]

Default pages: every committed study's report.html under results/cpu/ and the cross-study page
results/cpu/comparison/comparison.html. Each page is opened in headless Chromium (Debian's `chromium` and
`chromium-driver`, driven by Selenium), its collapsed sections are opened (`--collapsed` leaves them),
the window is made as tall as the page, and the screenshot is
written to DIR/<study>.png (default: ./screenshots); `--top PX` keeps only the first PX pixels (the
README's picture of the top of a report). The page's height and size are printed.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars")


def browser(width: int, profile: str):
    """A headless Chromium under Selenium with a fresh profile (None when Chromium is missing)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary = shutil.which("chromium") or "/usr/bin/chromium"
    driver_path = shutil.which("chromedriver") or "/usr/bin/chromedriver"
    if not Path(binary).exists() or not Path(driver_path).exists():
        return None
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={width},1000"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(driver_path), options=options)


def pages(args: list[str]) -> list[Path]:
    if not args:
        found = sorted((ROOT / "results" / "cpu").glob("*/report.html"))
        comparison = ROOT / "results" / "cpu" / "comparison" / "comparison.html"
        return found + ([comparison] if comparison.is_file() else [])
    out = []
    for a in args:
        p = Path(a)
        out.append(p / "report.html" if p.is_dir() else p)
    return out


def screenshot(driver, page: Path, out: Path, width: int, top: int | None, expand: bool = True) -> tuple[int, int]:
    """Open the page (every collapsed section opened when `expand`), size the window to its full height
    (or `top`), save the PNG; (height, bytes)."""
    driver.set_window_size(width, 800)  # a page shorter than the window would read as the window's height
    driver.get(page.resolve().as_uri())
    if expand:
        driver.execute_script("document.querySelectorAll('details').forEach(d => d.open = true);")
    height = int(driver.execute_script("return document.documentElement.scrollHeight"))
    driver.set_window_size(width, min(height, top) if top else height)
    driver.save_screenshot(str(out))
    return height, page.stat().st_size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pages", nargs="*")
    parser.add_argument("--out", default="screenshots")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--top", type=int, default=None, help="keep only the first PX pixels of each page")
    parser.add_argument("--collapsed", action="store_true", help="leave the collapsed sections closed")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as profile:
        driver = browser(args.width, profile)
        if driver is None:
            print("chromium or chromedriver is missing (apt-get install chromium chromium-driver)", file=sys.stderr)
            return 1
        try:
            for page in pages(args.pages):
                name = page.parent.name if page.name == "report.html" else page.stem
                target = out_dir / f"{name}.png"
                height, size = screenshot(driver, page, target, args.width, args.top, not args.collapsed)
                print(f"{page}: {height} px tall, {size / 1e6:.2f} MB -> {target}")
        finally:
            driver.quit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
