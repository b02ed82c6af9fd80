"""Serve a model over an OpenAI-compatible HTTP API with continuous batching and adaptive speculation.

    python scripts/serve.py                      # smollm2-135m, SAM speculation, http://127.0.0.1:8000
    python scripts/serve.py --policy off         # plain decoding only

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream: true`), GET /v1/models,
GET /health, GET /metrics (Prometheus). Beside OpenAI's fields a request may send `top_k`, `min_p`,
`ignore_eos`, `stop_token_ids` and `speculative` ({"method": "none"|"ngram"|"sam", "num_speculative_tokens": K}
or "off"). The command lives in the installed package, `jaxspec.serving.server` (`parse_args`, `main`).
"""

from jaxspec.serving.server import default_prediction_len, main, parse_args  # noqa: F401 (importable from here)

if __name__ == "__main__":
    raise SystemExit(main())
