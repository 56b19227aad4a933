"""The report's first screen as a browser shows it: headless Chromium writes a PNG.

    python -m pipeline.tools.screenshot --run runs/smollm2-135m     # -> <run>/report/first-screen.png
    make report-screenshot RUN=runs/smollm2-135m

Looks for `chromium`, `chromium-browser` or `google-chrome` on PATH (Debian: apt install chromium);
without one it says so in one line and exits 2. The window is 1280 x 1000 CSS pixels: what a
release manager sees before scrolling.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from pipeline.core.stage import StageError

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
WINDOW = (1280, 1000)


def browser() -> str:
    found = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if found is None:
        raise StageError(f"no headless browser found (looked for {', '.join(BROWSERS)}; Debian: apt install chromium)")
    return found


def screenshot(page: Path, out: Path, window: tuple[int, int] = WINDOW, timeout_s: float = 120.0) -> Path:
    """Render `page` (an HTML file) in headless Chromium and write its first screen to `out` (PNG)."""
    page = Path(page).resolve()
    if not page.is_file():
        raise StageError(f"{page} does not exist: run the report stage first (make report)")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as profile:
        tmp = out.with_name(out.name + ".tmp.png")
        cmd = [browser(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               f"--user-data-dir={profile}", f"--window-size={window[0]},{window[1]}",
               f"--screenshot={tmp}", page.as_uri()]
        try:
            subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise StageError(f"the browser did not finish in {timeout_s:.0f} s") from None
        if not tmp.is_file() or tmp.read_bytes()[:8] != b"\x89PNG\r\n\x1a\n":
            tmp.unlink(missing_ok=True)
            raise StageError(f"the browser wrote no screenshot of {page}")
        os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.tools.screenshot", description=__doc__.split("\n")[0])
    ap.add_argument("--run", required=True, help="a run directory with report/index.html")
    ap.add_argument("--out", default=None, help="default: <run>/report/first-screen.png")
    a = ap.parse_args(argv)
    run = Path(a.run)
    try:
        out = screenshot(run / "report" / "index.html", Path(a.out) if a.out else run / "report" / "first-screen.png")
    except StageError as e:
        print(f"specq: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
