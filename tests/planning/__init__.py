"""Tests of hftrain/planning/ (tests mirror the package)."""
