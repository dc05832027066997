"""Tests of ps/edge/."""
