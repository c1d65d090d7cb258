"""The way back: a run's rollback, ``--recover``, and the one put-back sequence they share."""
