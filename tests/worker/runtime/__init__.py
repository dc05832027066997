"""Tests of worker/runtime/."""
