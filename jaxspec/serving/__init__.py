"""The OpenAI-compatible server over `jaxspec.engine` (run it with `jaxspec serve`)."""

try:  # in the core install; `import jaxspec` itself (generation, the engine) needs none of it
    import fastapi  # noqa: F401
    import prometheus_client  # noqa: F401
    import pydantic  # noqa: F401
except ImportError as e:
    raise ImportError(f"jaxspec.serving needs fastapi, pydantic and prometheus-client: pip install jaxspec ({e})") \
        from e

from .app import create_app  # noqa: E402

__all__ = ["create_app"]
