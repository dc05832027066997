"""Tests of worker/report/."""
