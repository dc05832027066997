"""Tests of worker/dense/."""
