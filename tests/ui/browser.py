"""Headless Chromium driven by selenium (Debian's chromium and chromium-driver), for the web page's tests, its
screenshots and benchmarks/bench_ui.py. `missing()` says why a browser cannot start here (the tests skip with it)."""

from __future__ import annotations

import shutil
import tempfile


def chromium_paths() -> tuple[str | None, str | None]:
    browser = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    return browser, shutil.which("chromedriver")


def missing() -> str | None:
    browser, driver = chromium_paths()
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    if browser is None or driver is None:
        return "no chromium/chromedriver on PATH (apt-get install -y chromium chromium-driver; .ci/run does it)"
    return None


def start_browser(width: int = 1280, height: int = 800):
    """A fresh headless Chromium with its own profile, its console kept for goog:loggingPrefs."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver = chromium_paths()
    profile = tempfile.mkdtemp(prefix="fulcrum-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}", f"--window-size={width},{height}",
                 "--hide-scrollbars", "--force-device-scale-factor=1"):  # fmt: skip
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(options=opts, service=Service(driver))
    # the page's viewport itself at width x height (a window's size would include the browser's frame)
    d.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1,
                                                            "mobile": False})  # fmt: skip
    d.profile_dir = profile
    return d


def stop_browser(d) -> None:
    d.quit()
    shutil.rmtree(d.profile_dir, ignore_errors=True)


def console_errors(d) -> list[str]:
    """The page's console messages at level SEVERE since the last call (JS errors, CSP violations, failed loads)."""
    return [e["message"] for e in d.get_log("browser") if e["level"] == "SEVERE"]
