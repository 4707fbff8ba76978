"""kvtier's tiers attached and detached on a running server over HTTP (`routes`), the attach
itself on each rank (`attach`), and every TP rank's answer gathered (`tp_answers`)."""
