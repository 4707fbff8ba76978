"""LMCache compatibility: its config keys (`keys`), what kvtier does with each (`compat`), and
the rewrite of an LMCache file into kvtier's own keys (`migrate`, `kvtier migrate-config`)."""
