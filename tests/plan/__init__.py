"""Tests of hftrain/plan/ (tests mirror the package)."""
