"""A real browser renders the report a real run wrote: headless Chromium (Debian's
chromium and chromium-driver, which .ci/run installs when missing), driven through
Selenium, loads RUN/report.html from disk with no network."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import run_cli, run_main

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")

needs_browser = pytest.mark.skipif(
    not (CHROMIUM and DRIVER),
    reason="Chromium and its driver are not installed (Debian: apt-get install chromium "
    "chromium-driver; .ci/run installs them where it can)",
)

# As the machine's own browser tests start it: no background connections on a closed
# network, a fresh profile.
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-quic", "--no-first-run", "--window-size=1200,900")


def _browse(page: Path, profile: Path) -> tuple[list, str, bytes, list, list]:
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    options = Options()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    try:
        driver.get(page.resolve().as_uri())
        sizes = driver.execute_script(
            "return Array.from(document.querySelectorAll('svg, img')).map(e => {"
            "const r = e.getBoundingClientRect(); return [r.width, r.height]; })"
        )
        # The page's full width and its visible width: a table that runs off widens the first.
        widths = driver.execute_script(
            "const d = document.documentElement; return [d.scrollWidth, d.clientWidth];"
        )
        text = driver.find_element(By.TAG_NAME, "body").text
        png = driver.get_screenshot_as_png()
        logs = driver.get_log("browser")
    finally:
        driver.quit()
    return sizes, text, png, logs, widths


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    """A real (one-worker) run, its report as JSON, and what `trainwise train` printed."""
    root = tmp_path_factory.mktemp("report")
    res = run_cli(
        "train", "--nproc", "1", "--strategy", "single", "--steps", "6", "--run-dir", "run",
        "--set", "logging.progress=none", "--set", "logging.tensorboard=false",
        "--set", "logging.profile_steps=[3, 4]", cwd=root,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "report     run/report.html" in res.stdout
    made = run_main("report", "run", "--format", "json", cwd=root)
    assert made.returncode == 0, made.stderr
    return root / "run", json.loads(made.stdout)["runs"][0], res.stdout


def test_every_train_ends_by_writing_its_report(trained):
    run_dir, report, _ = trained
    page = (run_dir / "report.html").read_text()
    assert page.count("<svg") == 5 and "<script" not in page  # with the traced window's
    assert report["headline"]["steps_done"] == 6 and report["plan_vs_actual"]
    assert (run_dir / "plan.json").is_file()  # what the plan-versus-actual rows compare with


def test_the_terminal_and_the_report_give_the_same_wall_time(trained):
    from trainwise.plan.units import fmt_seconds

    run_dir, report, printed = trained
    wall = f"wall {fmt_seconds(report['headline']['wall_s'])} s"
    assert f"({wall})" in printed, printed  # the terminal summary
    assert wall in (run_dir / "report.html").read_text()


@needs_browser
def test_a_real_browser_shows_every_picture_and_the_headline_numbers(trained, tmp_path: Path):
    run_dir, run, _ = trained
    sizes, text, png, logs, widths = _browse(run_dir / "report.html", tmp_path / "profile")
    (tmp_path / "report.png").write_bytes(png)  # kept for a look when the test fails
    assert not [e for e in logs if e["level"] == "SEVERE"], logs
    assert len(sizes) == 5 and all(w > 50 and h > 50 for w, h in sizes), sizes
    assert png.startswith(b"\x89PNG") and len(png) > 20_000
    # Every table keeps to the page (the plan's "assumption to check" sentences wrap).
    assert any(c["assumption"] for c in run["plan_vs_actual"])
    page_width, visible = widths
    assert page_width <= visible, widths
    h = run["headline"]
    for number in (f"{h['final_loss']:.4f}", f"{run['cost']['total_gpu_hours']:.3g}", "tiny"):
        assert number in text, number
    # Where to look next: the traced window's top operator and the trace's link.
    assert "Where to look next" in text and run["drill"]["top"][0]["name"] in text
    assert "profile/trace-rank-0.json" in text and "needs CUDA" in text
