"""Pure policy: the run and attempt state machines, the recovery decision and outcome → transition rules.

No I/O, no Ray, no SQL: every function here is table-tested on plain values.
"""
