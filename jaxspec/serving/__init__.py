"""The OpenAI-compatible server over `jaxspec.engine` (run it with `python scripts/serve.py`)."""

from .app import create_app

__all__ = ["create_app"]
