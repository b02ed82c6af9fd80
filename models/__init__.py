"""Model definitions and weight loading, installed as ``jaxspec.models``."""
