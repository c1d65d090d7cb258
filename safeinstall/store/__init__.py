"""What root keeps: the state directory, the crash journal, history, backups and their retention, what
checks keep between runs, the run's log. Never imports scan.
"""
