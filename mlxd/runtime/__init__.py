"""Process-level runtime concerns (BLAS selection)."""
