"""Screenshots of the dashboard in headless Chromium (Debian's ``chromium`` and
``chromium-driver`` packages, driven by Selenium; never a driver Selenium Manager would
download): the rollouts page, the rollout with the most LLM calls, training, pipeline.

    python -m spanrl.infra.dashboard.screenshots --out docs/data/dashboard [--url http://127.0.0.1:18092]

With ``SPANRL_AUTH_TOKEN`` set the first page is opened with ``?token=`` (the dashboard then
sets its cookie, infra/dashboard/auth.py). Used by tests/integration/test_dashboard.py
(:func:`headless_chromium`) and for the Operations page's pictures (docs/operations.md).
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

#: Debian's packages (chromium, chromium-driver)
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@contextmanager
def headless_chromium(width: int = 1400, height: int = 1000):
    """A Selenium Chrome driver on Debian's Chromium; FileNotFoundError naming the package
    when one is missing."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    for path in (CHROMIUM, CHROMEDRIVER):
        if not Path(path).exists():
            raise FileNotFoundError(f"{path} missing: apt-get install -y chromium chromium-driver "
                                    "(infra/bootstrap.sh does)")
    profile = Path(tempfile.mkdtemp(prefix="spanrl-chrome-"))
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}", f"--user-data-dir={profile}"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def full_page(driver, path: Path) -> Path:
    """Save a screenshot of the whole page (the window grown to the page's height, ≤ 4000 px)."""
    height = min(4000, int(driver.execute_script("return document.body.scrollHeight")) + 40)
    driver.set_window_size(driver.get_window_size()["width"], max(600, height))
    path.parent.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(path))
    return path


def capture(url: str, out_dir: Path, token: str | None = None) -> list[Path]:
    """rollouts.png, rollout.png (the listed rollout with the most LLM calls), training.png,
    pipeline.png under ``out_dir``; returns their paths. RuntimeError when no rollout is listed."""
    from selenium.webdriver.common.by import By

    url = url.rstrip("/")
    saved = []
    with headless_chromium() as driver:
        driver.get(url + "/" + (f"?token={quote(token)}" if token else ""))
        saved.append(full_page(driver, out_dir / "rollouts.png"))
        rows = driver.find_elements(By.CSS_SELECTOR, "tr.rollout-row")
        if not rows:
            raise RuntimeError(f"{url}: no rollout listed yet")
        best = max(rows, key=lambda r: int(r.get_attribute("data-llm-calls") or 0))
        rid = best.get_attribute("data-rollout")
        driver.get(f"{url}/rollouts/{quote(rid)}")
        saved.append(full_page(driver, out_dir / "rollout.png"))
        for name in ("training", "pipeline"):
            driver.get(f"{url}/{name}")
            saved.append(full_page(driver, out_dir / f"{name}.png"))
    return saved


def main(argv: list[str] | None = None) -> None:
    from spanrl.core.edge import token_value
    from spanrl.core.settings import get_settings

    s = get_settings()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=s.dashboard_url)
    p.add_argument("--out", type=Path, default=Path("docs/data/dashboard"))
    a = p.parse_args(argv)
    for path in capture(a.url, a.out, token_value(s.auth_token)):
        print(path)


if __name__ == "__main__":
    main()
