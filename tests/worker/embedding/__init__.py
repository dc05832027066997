"""Tests of worker/embedding/."""
