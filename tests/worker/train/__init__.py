"""Tests of worker/train/."""
