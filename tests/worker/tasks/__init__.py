"""Tests of worker/tasks/."""
