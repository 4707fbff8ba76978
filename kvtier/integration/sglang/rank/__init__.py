"""One TP rank's scheduler side: the adapter over kvtier's engine, the radix-cache backend and
its prefetch hooks, background stores, the scheduler-thread budget, tier events."""
