"""Render the HTML report of one trace, or of a comparison of two, and screenshot it in headless
Chromium: one command for the README's picture and for looking at a report on a machine
without a display.

    python -m ds4eval.reports.screenshot BASE.trace NEW.trace OUT.png    # a comparison
    python -m ds4eval.reports.screenshot RUN.trace OUT.png               # one run
    options: --html FILE (default OUT with .html), --width 1400, --height 0 (the whole page,
             at most MAX_HEIGHT), --view 'status=FAILED' (a filtered view, as the URL hash),
             --allow-diff model|prompt|sampling (as for ds4-eval --compare)

Contract
- `headless_chrome(width, height)` starts Chromium through selenium with flags that work as
  root in a container (`--headless=new --no-sandbox --disable-gpu --disable-dev-shm-usage`),
  using the system `chromium` and `chromedriver` (Debian packages `chromium chromium-driver`;
  `make setup-browser` installs them and the `browser` extra). It never downloads a browser
  or a driver. `BrowserMissing` says what is absent.
- `screenshot(html_path, png_path, ...)` loads the file by its file:// URL and writes a PNG.
- `render_html(traces, allow=())`: the page of one trace or of a comparison of two, through
  `reports.formats`, each file read and parsed once.
It is a tool, not a library seam: the page itself is `reports.html`'s, and the CLI's
`--report` needs no browser.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import click

from ds4eval.config import ALLOWED_DIFFS

MAX_HEIGHT = 12000  # pixels: a whole-page shot of a thousand-case report stops here
CHROME_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars")


class BrowserMissing(RuntimeError):
    """Chromium, chromedriver or selenium is not installed; the message says which."""


def browser_paths() -> tuple[str, str]:
    """(chromium, chromedriver) from PATH; BrowserMissing when either is absent."""
    chrome = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)
    driver = shutil.which("chromedriver")
    if not chrome or not driver:
        missing = " and ".join(n for n, p in (("chromium", chrome), ("chromedriver", driver)) if not p)
        raise BrowserMissing(f"{missing} not found on PATH (make setup-browser installs them)")
    return chrome, driver


def headless_chrome(width: int = 1400, height: int = 1000):
    """A selenium WebDriver for headless Chromium of this window size."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        raise BrowserMissing("selenium is not installed (pip install -e '.[browser]')") from None
    chrome, driver = browser_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = chrome
    for flag in CHROME_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--window-size={width},{height}")
    return webdriver.Chrome(service=Service(executable_path=driver), options=options)


def file_url(path: str | os.PathLike, view: str = "") -> str:
    url = Path(path).resolve().as_uri()
    return f"{url}#{view}" if view else url


def screenshot(html_path: str | os.PathLike, png_path: str | os.PathLike, width: int = 1400, height: int = 0,
               view: str = "") -> None:
    """Load the page and write a PNG; height 0 takes the whole page (at most MAX_HEIGHT)."""
    drv = headless_chrome(width, height or 1000)
    try:
        set_viewport(drv, width, height or 1000)
        drv.get(file_url(html_path, view))
        if not height:
            full = drv.execute_script("return document.documentElement.scrollHeight")
            set_viewport(drv, width, min(MAX_HEIGHT, int(full)))
        drv.save_screenshot(os.fspath(png_path))
    finally:
        drv.quit()


def set_viewport(drv, width: int, height: int) -> None:
    """The page's viewport in CSS pixels, exactly: a window size would include the browser's own
    frame, which differs between Chromium versions."""
    drv.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})


def render_html(traces: list[str], allow: tuple[str, ...] = ()) -> str:
    """The HTML report of one trace, or of a comparison of two (traces or summaries); each file
    is read and parsed once, and the comparison carries its runs' records to the page."""
    from ds4eval.reports import formats
    from ds4eval.run import trace
    from ds4eval.verdict import compare

    texts = []
    for p in traces:
        with open(p, encoding="utf-8", newline="") as f:
            texts.append(f.read())
    if len(traces) == 1:
        return formats.render_run(trace.parse_trace(texts[0]).records, "html", traces[0])
    base, new = (compare.read_run(t, p) for t, p in zip(texts, traces))
    return formats.render_comparison(compare.compare(base, new, allow=allow), "html")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("paths", nargs=-1, required=True, metavar="[BASE] TRACE OUT.png")
@click.option("--html", "html_path", type=click.Path(dir_okay=False), help="Where the HTML goes (default OUT.html).")
@click.option("--width", type=int, default=1400, show_default=True)
@click.option("--height", type=int, default=0, show_default=True, help="0: the whole page.")
@click.option("--view", default="", help="URL hash of a filtered view, e.g. 'status=pass-fail'.")
@click.option("--allow-diff", "allow_diff", multiple=True, type=click.Choice(ALLOWED_DIFFS),
              help="As for ds4-eval --compare: keep cases whose model, prompt or sampling differs.")
def main(paths, html_path, width, height, view, allow_diff) -> None:
    """Screenshot the HTML report of one trace or of a comparison of two."""
    from ds4eval.atomicfile import write_text_atomic
    from ds4eval.verdict.compare import CompareInputError

    if len(paths) not in (2, 3) or not paths[-1].endswith(".png"):
        click.echo("usage: python -m ds4eval.reports.screenshot [BASE] TRACE OUT.png", err=True)
        sys.exit(2)
    *traces, png = paths
    html_path = html_path or str(Path(png).with_suffix(".html"))
    try:
        write_text_atomic(html_path, render_html(traces, tuple(allow_diff)))
        screenshot(html_path, png, width, height, view)
    except (OSError, UnicodeDecodeError, CompareInputError, BrowserMissing) as e:
        click.echo(f"ds4eval.reports.screenshot: error: {e}", err=True)
        sys.exit(2)
    click.echo(f"wrote {html_path} and {png}")


if __name__ == "__main__":
    main()
