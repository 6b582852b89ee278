"""An empty generation over the API and on the web page: "no answer (why)" where a person reads
the answer (the message content, the page's answer list and live view), the model's own text and
the reason beside it in ARR-COC's extension."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from pipeline.runtime.answer_words import EMPTY

from serve_client import API_KEY, call, chat_body, sse

APP_JS = Path(__file__).resolve().parents[3] / "pipeline" / "serve" / "static" / "app.js"


@pytest.fixture(scope="module")
def silent_server(videos, tmp_path_factory, silent_vlms):
    """The serve tests' server, with a VLM that generates nothing."""
    from pipeline.config import DecodeConfig, PipelineConfig, RuntimeConfig
    from pipeline.serve.app import create_app
    from pipeline.serve.options import ServeOptions
    from pipeline.serve.server import BackgroundServer, build_engine
    from pipeline.vlm_config import VLMConfig

    cfg = PipelineConfig(runtime=RuntimeConfig(device="cpu", vlm="tiny-random", batch_size=8, model_weights="none"),
                         vlm=VLMConfig(max_new_tokens=2), decode=DecodeConfig(process=False))
    options = ServeOptions(allow_dirs=(videos.allowed,), api_key=API_KEY,
                           store=str(tmp_path_factory.mktemp("silent") / "serve.zarr"))
    with silent_vlms():
        engine = build_engine(cfg, options)
    background = BackgroundServer(create_app(engine)).start()
    yield background
    background.stop()


def test_the_message_says_no_answer_and_the_extension_keeps_the_text(silent_server, videos):
    status, body = call(silent_server, "POST", "/v1/chat/completions", chat_body(videos.small.as_uri()))
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == f"no answer ({EMPTY})"
    answer = body["arrcoc"]["answers"][0]
    assert answer["text"] == "" and answer["no_answer"] == EMPTY
    status, homunculus = call(silent_server, "GET", f"/v1/homunculus/{body['id']}")
    assert status == 200 and homunculus["answers"][0]["no_answer"] == EMPTY


def test_streamed_windows_say_no_answer(silent_server, videos):
    events = list(sse(silent_server, "/v1/chat/completions", chat_body(videos.small.as_uri(), stream=True, every=1.0)))
    text = "".join(data["choices"][0]["delta"].get("content", "") for _, data, _ in events
                   if isinstance(data, dict) and data.get("choices"))
    lines = text.splitlines()
    assert lines and all(re.fullmatch(rf"\[\d+\.\d-\d+\.\d s\] no answer \({EMPTY}\)", line) for line in lines), text


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js to run the page's answer formatting")
def test_the_page_shows_no_answer_with_its_reason():
    """The page's one formatting rule (app.js: answerText), used by the answer list, the timeline
    and the live view, run as the browser would run it."""
    source = APP_JS.read_text()
    rule = re.search(r"^const answerText = .*;$", source, re.M)
    assert rule is not None, "app.js: answerText is gone"
    uses = len(re.findall(r"answerText\((a|data)\)", source))
    assert uses >= 3 and not re.search(r"\$\{(a|data)\.text\}|= a\.text;", source)
    script = rule.group(0) + ("\nconsole.log(JSON.stringify([answerText({text: '', no_answer: 'the model generated "
                              "nothing'}), answerText({text: 'red', no_answer: ''})]));")
    out = subprocess.run(["node", "-e", script], capture_output=True, text=True, check=True, timeout=60).stdout
    assert json.loads(out) == [f"no answer ({EMPTY})", "red"]
