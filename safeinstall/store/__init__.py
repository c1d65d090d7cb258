"""What root keeps: the state directory, the crash journal, history, backups, the put-back sequence,
the run's log. Never imports scan.
"""
