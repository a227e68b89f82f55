"""Regenerate the web page's screenshots in docs/ (1280x800): the chat playground, the live dashboard under load and
the bench viewer on a real `fulcrum bench serve` sweep, all against `fulcrum serve` on the bundled model.

    python scripts/ui_screenshots.py            # needs chromium + chromium-driver and selenium (the dev extra)
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from selenium.webdriver.common.by import By  # noqa: E402

from fulcrum.utils.serve_process import start  # noqa: E402
from tests.ui.browser import console_errors, missing, start_browser, stop_browser  # noqa: E402

DOCS = ROOT / "docs"


def bench(url: str, out: Path, concurrency: str, num_prompts: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "fulcrum.cli", "bench", "serve", "--base-url", url, "--concurrency", concurrency,
           "--num-prompts", str(num_prompts), "--input-len", "96", "--output-len", "48", "--slo", "ttft=60ms,tpot=12ms",
           "--price-per-hour", "1.2", "--out", str(out), "--quiet", "--endpoint", "chat"]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL)


def wait(d, script: str, timeout: float = 60):
    end = time.monotonic() + timeout
    while not d.execute_script(script):
        if time.monotonic() > end:
            raise TimeoutError(script)
        time.sleep(0.1)


def main() -> int:
    if why := missing():
        print(f"error: {why}", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="fulcrum-shots-"))
    server = start(None, "--kv-cache-memory", "0.05", log_path=tmp / "serve.log", timeout=120)
    d = start_browser(1280, 800)
    try:
        sweep = tmp / "sweep.json"
        bench(server.url, sweep, "1,2,4,8", 24).wait()

        d.get(server.url + "/#chat")
        wait(d, "return document.getElementById('model').options.length > 0")
        d.execute_script("""
            document.getElementById('system').value = 'You are a player in a Shakespeare company.';
            document.getElementById('max_tokens').value = 70;
            document.getElementById('seed').value = 3;""")
        d.find_element(By.ID, "prompt").send_keys("Good morrow, what news from the court?")
        d.find_element(By.ID, "send").click()
        wait(d, "return document.querySelector('.turn.done') !== null")
        d.execute_script("""
            document.getElementById('n').value = 2;
            document.getElementById('max_tokens').value = 40;
            document.getElementById('logprobs').checked = true;""")
        d.find_element(By.ID, "prompt").send_keys("And of the king?")
        d.find_element(By.ID, "send").click()
        wait(d, "return document.querySelectorAll('.turn.done').length === 2")
        d.save_screenshot(str(DOCS / "ui-chat.png"))

        load = bench(server.url, tmp / "load.json", "6", 400)  # the dashboard under load
        d.get("about:blank")
        d.get(server.url + "/#dashboard")
        d.execute_script("const s = document.getElementById('poll-interval'); s.value = '1000';"
                         "s.dispatchEvent(new Event('change'))")  # fmt: skip
        time.sleep(25)
        d.save_screenshot(str(DOCS / "ui-dashboard.png"))
        load.terminate()
        load.wait()

        d.get("about:blank")
        d.get(server.url + "/#bench")
        d.find_element(By.ID, "bench-files").send_keys(str(sweep))
        wait(d, "return document.querySelectorAll('#bench-table tbody tr').length > 0")
        d.save_screenshot(str(DOCS / "ui-bench.png"))
        errors = console_errors(d)
        if errors:
            print("console errors:", *errors, sep="\n  ", file=sys.stderr)
            return 1
    finally:
        stop_browser(d)
        server.stop()
    for name in ("ui-chat.png", "ui-dashboard.png", "ui-bench.png"):
        print(DOCS / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
