"""kvtier's tiers attached and detached on a running server over HTTP: the launcher's routes
(`routes`), each rank's side of every op (`ops`), the attach itself on each rank (`attach`), and
every TP rank's answer gathered (`tp_answers`)."""
