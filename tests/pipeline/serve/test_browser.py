"""The viewer page in a real browser: headless Chromium (Debian's `chromium`, installed by .ci/run)
driven by Playwright's Python package with that executable (no browser download). Uploads the demo
video, asks, sees the answer, checks the homunculus overlay and the timeline's scene changes, follows
a live stream."""
from __future__ import annotations

import os
import shutil

import pytest

from serve_client import API_KEY

CHROMIUM = next((p for p in (os.environ.get("CHROMIUM"), shutil.which("chromium"), shutil.which("chromium-browser"))
                 if p), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="the web page's browser tests need Chromium, not found: "
                                                          "apt-get install chromium (Debian; .ci/run does), or "
                                                          "CHROMIUM=/path/to/chromium")


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs Playwright's Python package")
    with sync_api.sync_playwright() as p:
        # root (CI, containers) cannot use Chromium's sandbox
        chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, server):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.url + "/")
    page.fill("#apikey", API_KEY)
    page.dispatch_event("#apikey", "change")
    page.wait_for_function("document.getElementById('model').textContent.includes('tiny-random')")
    yield page
    page.close()
    assert errors == [], errors


def test_upload_ask_and_watch_the_homunculus(page, videos, tmp_path):
    page.set_input_files("#file", str(videos.demo))
    page.fill("#question", "where is the red square?")
    page.fill("#every", "2")
    page.click("#ask")
    page.wait_for_function("['answered', 'failed'].includes(document.body.dataset.state)", timeout=90_000)
    assert page.get_attribute("body", "data-state") == "answered", page.inner_text("#status")
    # the answer appeared, one list entry per window it covers
    windows = page.locator("#answers li .when").all_inner_texts()
    assert windows[0].startswith("0.0–2.0") and len(windows) == 3
    assert page.locator("#answers li .tok").first.inner_text().endswith("tokens")
    assert page.inner_text("#answer").startswith("[0.0-2.0 s]")
    assert "visual tokens" in page.inner_text("#usage")

    # the overlay covers the video and has drawn on it
    video_box, canvas_box = page.locator("#video").bounding_box(), page.locator("#overlay").bounding_box()
    assert abs(video_box["width"] - canvas_box["width"]) < 1 and abs(video_box["height"] - canvas_box["height"]) < 1
    drawn = page.evaluate("""() => {
        const c = document.getElementById('overlay');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let painted = 0, kept = 0;
        for (let i = 0; i < d.length; i += 4) {
            if (d[i + 3] > 0) painted++;
            if (d[i + 3] > 0 && d[i] > 200 && d[i + 2] < 120) kept++;     // the orange of a kept token
        }
        return {painted, kept, total: c.width * c.height};
    }""")
    assert drawn["total"] > 0 and drawn["painted"] > 0.5 * drawn["total"] and drawn["kept"] > 0, drawn

    # the timeline marks the demo's scene changes
    cuts = [float(t) for t in page.eval_on_selector_all("#cuts .cut", "marks => marks.map(m => m.dataset.t)")]
    assert len(cuts) == len(videos.demo_cuts_s)
    assert all(abs(a - b) < 0.05 for a, b in zip(cuts, videos.demo_cuts_s)), cuts
    assert page.locator("#windows .window").count() == 3

    # the overlay follows the video: seek past the second cut, the frame shown changes with it
    page.wait_for_function("document.getElementById('video').readyState >= 1", timeout=10_000)
    page.evaluate("document.getElementById('video').currentTime = 3.3")
    page.wait_for_function("document.getElementById('frame-info').textContent.startsWith('frame 82 ')")
    assert "3.28 s" in page.inner_text("#frame-info") and "/ " in page.inner_text("#frame-info")
    page.screenshot(path=str(tmp_path / "viewer.png"), full_page=True)


def test_the_live_view_shows_answers_arriving(page, videos):
    page.click("#tab-live")
    page.fill("#live-source", videos.demo.as_uri())
    page.fill("#live-question", "what is happening now?")
    page.fill("#live-every", "1")
    page.click("#live-start")
    card = page.locator(".stream", has_text="what is happening now?")     # other tests' streams may run too
    card.locator(".events li.answer").first.wait_for(timeout=60_000)
    assert card.locator(".source").inner_text() == videos.demo.as_uri()
    assert "tokens" in card.locator(".events li.answer").first.inner_text()
    card.locator(".stop").click()
    card.locator(".events li.end").wait_for(timeout=30_000)
    assert card.locator(".state").inner_text() == "stopped"
