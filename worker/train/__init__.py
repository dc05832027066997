"""The training loop, its pipeline and time budget. May import every room (it is the
last).
"""
