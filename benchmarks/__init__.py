"""Maintained benchmarks (see README.md here); a package so tests can import their analysis code."""
