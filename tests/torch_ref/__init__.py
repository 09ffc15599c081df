"""Independent PyTorch reference implementations used by the tests (never by jaxgrpo)."""
