"""The HTML reports in a real headless Chromium (selenium): the page renders, its tables and SVG
plots are in the DOM, a screenshot is a real picture, and the status filter hides rows both
from its control and from the URL hash. Skipped when chromium, chromedriver or selenium is
absent (`make setup-browser` installs them)."""

import struct

import pytest
from report_fakes import HOSTILE, comparison, flip_pair, repeated_records, run_records

from ds4eval.reports import formats
from ds4eval.reports import screenshot

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def driver():
    pytest.importorskip("selenium")
    try:
        screenshot.browser_paths()
    except screenshot.BrowserMissing as e:
        pytest.skip(str(e))
    drv = screenshot.headless_chrome(1400, 1000)
    yield drv
    drv.quit()


def _visible_rows(drv) -> list[str]:
    return drv.execute_script(
        "return Array.from(document.querySelectorAll('#case-table tbody tr'))"
        ".filter(function (r) { return r.offsetParent !== null; }).map(function (r) { return r.id; });")


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_comparison_page_renders_filters_and_screenshots(driver, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    base, new = flip_pair()
    page = tmp_path / "compare.html"
    page.write_text(formats.render_comparison(comparison(base, new), "html"), encoding="utf-8")
    url = screenshot.file_url(page)
    driver.get(url)

    shot = tmp_path / "compare.png"
    assert driver.save_screenshot(str(shot))
    width, height = _png_size(shot)
    assert width >= 1000 and height >= 600 and shot.stat().st_size > 20_000

    for table_id in ("runs-table", "rate-table", "flip-table", "time-table", "case-table"):
        assert driver.find_element(By.ID, table_id).is_displayed()
    hist = driver.find_element(By.ID, "length-histogram")
    assert hist.tag_name == "svg" and hist.size["width"] > 300
    assert hist.find_elements(By.CSS_SELECTOR, "rect.s-base") and hist.find_elements(By.CSS_SELECTOR, "rect.s-new")
    assert len(driver.find_elements(By.CSS_SELECTOR, "#delta-plot circle")) == 3  # alpha, beta, TOTAL
    assert len(_visible_rows(driver)) == 10
    assert driver.find_element(By.ID, "filter-count").text == "10 of 10 shown"

    # The control: only the two pass->fail flips stay, and the hash records the view.
    Select(driver.find_element(By.ID, "filter-status")).select_by_value("pass-fail")
    assert _visible_rows(driver) == ["case-2", "case-3"]
    assert driver.execute_script("return window.location.hash") == "#status=pass-fail"
    assert driver.find_element(By.ID, "filter-count").text == "2 of 10 shown"
    Select(driver.find_element(By.ID, "filter-status")).select_by_value("")
    assert len(_visible_rows(driver)) == 10

    # The URL hash alone, as a link or a headless screenshot would open it.
    driver.get(url + "#status=FAILED&source=alpha")
    driver.refresh()
    assert _visible_rows(driver) == ["case-3"]
    assert Select(driver.find_element(By.ID, "filter-status")).first_selected_option.get_attribute("value") == "FAILED"
    driver.get(url + "#status=base-PASSED")
    assert len(_visible_rows(driver)) == 10

    # A case's details open to show both outputs, the thinking folded inside.
    driver.get(url + "#case-2")
    row = driver.find_element(By.ID, "case-2")
    row.find_element(By.TAG_NAME, "summary").click()
    assert "NEW-THINKING" not in row.find_element(By.CSS_SELECTOR, "pre.answer").text
    think = row.find_element(By.CSS_SELECTOR, "details.think")
    assert not think.find_element(By.TAG_NAME, "pre").is_displayed()
    think.find_element(By.TAG_NAME, "summary").click()
    assert "NEW-THINKING" in think.find_element(By.TAG_NAME, "pre").text


def test_run_page_with_repeats_and_hostile_text(driver, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    page = tmp_path / "run.html"
    page.write_text(formats.render_run(run_records() + repeated_records(), "html"), encoding="utf-8")
    url = screenshot.file_url(page)
    driver.get(url)
    # The hostile text stayed text: no image was made from it, and the page shows it as written.
    assert driver.execute_script("return document.images.length") == 0
    driver.find_element(By.CSS_SELECTOR, "#case-2 summary").click()
    assert HOSTILE in driver.find_element(By.CSS_SELECTOR, "#case-2 pre.q").text
    for el_id in ("provenance-table", "rate-table", "flaky-table", "rate-plot", "length-histogram"):
        assert driver.find_element(By.ID, el_id).is_displayed()
    total = len(_visible_rows(driver))
    Select(driver.find_element(By.ID, "filter-status")).select_by_value("FAILED")
    failed = _visible_rows(driver)
    assert 0 < len(failed) < total
    assert all("FAILED" in driver.find_element(By.ID, r).text for r in failed)
    Select(driver.find_element(By.ID, "filter-source")).select_by_value("beta")
    assert driver.execute_script("return window.location.hash") == "#status=FAILED&source=beta"
    assert _visible_rows(driver) == ["case-9", "case-12"]
    driver.get(url + "#status=ERROR")
    assert len(_visible_rows(driver)) == 1


def test_screenshot_command_writes_html_and_png(driver, tmp_path):
    from click.testing import CliRunner

    from report_fakes import trace_text

    base, new = flip_pair()
    (tmp_path / "b.trace").write_text(trace_text(base))
    (tmp_path / "n.trace").write_text(trace_text(new))
    out = tmp_path / "shot.png"
    r = CliRunner().invoke(screenshot.main, [str(tmp_path / "b.trace"), str(tmp_path / "n.trace"), str(out),
                                             "--height", "900", "--view", "status=pass-fail"])
    assert r.exit_code == 0, r.output
    assert _png_size(out) == (1400, 900) and (tmp_path / "shot.html").read_text().startswith("<!DOCTYPE html>")


def test_per_case_repeat_table_sorts_by_a_clicked_heading(driver, tmp_path):
    from report_fakes import counted_repeats
    from selenium.webdriver.common.by import By

    base = counted_repeats({"b": 5, "a": 3, "c": 0, "d": 5})
    new = counted_repeats({"b": 0, "a": 1, "c": 0, "d": 4})
    page = tmp_path / "repeats.html"
    page.write_text(formats.render_comparison(comparison(base, new), "html"), encoding="utf-8")
    driver.get(screenshot.file_url(page))

    def cases() -> list[str]:
        return [r.find_element(By.CSS_SELECTOR, "td").text
                for r in driver.find_elements(By.CSS_SELECTOR, "#repeat-case-table tbody tr")]

    assert cases()[0] == "s/b"  # 5/5 -> 0/5: the smallest p first
    heads = driver.find_elements(By.CSS_SELECTOR, "#repeat-case-table th")
    heads[0].click()
    assert cases() == ["s/a", "s/b", "s/c", "s/d"]
    heads[0].click()
    assert cases() == ["s/d", "s/c", "s/b", "s/a"]
    heads[2].click()  # NEW k/K, numerically: 0/5 (b, c), 1/5 (a), 4/5 (d)
    assert cases()[2:] == ["s/a", "s/d"]
