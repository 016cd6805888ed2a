"""``python -m orchestrator.scheduler``: the scheduler alone, in the foreground."""

from orchestrator.scheduler.loop import main

main()
