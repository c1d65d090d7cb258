"""The host's edges: the safe filesystem layer, child processes and workers as other accounts, signals,
systemd, cgroups, NVML, health probes, the lock. Knows nothing of Python environments.
"""
