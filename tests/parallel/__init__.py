"""Tests of hftrain/parallel/ (tests mirror the package)."""
