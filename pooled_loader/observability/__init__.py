"""Where the time goes: stage timers (stages), the counters and verdict of stats()/report()
(stats), Chrome traces (trace) and optional progress bars (progress).

Imports only core/."""
