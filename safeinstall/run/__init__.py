"""The runs: the survey, preflight, the safe reinstall's steps, recovery, undo, patches, detach,
metrics, and the result types and JSON document they return.
"""
