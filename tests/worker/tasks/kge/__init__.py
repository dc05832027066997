"""Tests of worker/tasks/kge/."""
