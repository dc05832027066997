"""The rank's process: devices and process groups, rendezvous, graceful stop, the launcher
watch, host/device copies and sync points, fault injection. May import: config.
"""
