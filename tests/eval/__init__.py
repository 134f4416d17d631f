"""Tests of hftrain/eval/ (tests mirror the package)."""
