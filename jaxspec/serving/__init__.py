"""The OpenAI-compatible server over `jaxspec.engine` (run it with `python scripts/serve.py`)."""

try:  # the [serve] extra; the core install (`import jaxspec`, generation, the engine) needs none of it
    import fastapi  # noqa: F401
    import prometheus_client  # noqa: F401
    import pydantic  # noqa: F401
except ImportError as e:
    raise ImportError(f"jaxspec.serving needs the serving extra: pip install 'jaxspec[serve]' ({e})") from e

from .app import create_app  # noqa: E402

__all__ = ["create_app"]
