"""Who uses the environment: processes, their evidence and units, and the plan built from them. Never
imports store."""
