"""The server's default start: /health answers once the plain programs are compiled, requests are served plainly
(the same text) while the speculative chunk compiles on a thread, and speculation starts once the log says so.

One `python scripts/serve.py` process (real SmolLM2 weights), one slot, the fixed policy (every request drafts
when it can), default `--background-compile`. A request served before the speculative chunk is ready scores no
draft; the same request afterwards drafts, has drafts accepted and gives the same text.

Marked slow (deselected by default; the speculative chunk takes minutes to compile on a small CPU):
`python -m pytest -m slow tests/test_server_startup.py`.
"""

from __future__ import annotations

import time

import httpx
import pytest

from test_server import _serving, _wait_idle  # the real server test's process helpers

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

MODEL = "smollm2-135m"
READY_LINE = "speculation on at 1 slots"
COMPILE_TIMEOUT_S = 900


def _complete(url: str) -> str:
    body = {"model": MODEL, "prompt": "def fibonacci(n):", "max_tokens": 48, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_serves_plainly_then_speculates_once_compiled(smollm2, tmp_path):
    args = ["--background-compile", "--max-slots", "1", "--cache-len", "512", "--chunk-steps", "4",
            "--policy", "fixed", "--log-level", "info"]
    with _serving(args, tmp_path / "serve.log") as server:
        url, log = server["url"], server["log"]
        compiled_before = READY_LINE in log.read_text()
        first = _complete(url)
        before = _wait_idle(url)
        if not compiled_before and READY_LINE not in log.read_text():  # the whole request ran plainly
            assert before["jaxspec_spec_drafted_tokens_total"] == 0
        deadline = time.monotonic() + COMPILE_TIMEOUT_S
        while READY_LINE not in log.read_text():
            assert time.monotonic() < deadline, f"speculation not compiled in {COMPILE_TIMEOUT_S} s"
            time.sleep(2)
        assert _complete(url) == first
        after = _wait_idle(url)
        assert after["jaxspec_spec_drafted_tokens_total"] > before["jaxspec_spec_drafted_tokens_total"]
        assert after["jaxspec_spec_accepted_tokens_total"] > before["jaxspec_spec_accepted_tokens_total"]
