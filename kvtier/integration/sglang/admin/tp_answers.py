"""Every TP rank's answer to one admin op, gathered at TP rank 0 (which alone replies).

SGLang sends a control request's reply from TP rank 0 of each DP group only, though every TP
rank applies it (the request is broadcast over the TP group's CPU group before any rank handles
it). An op whose effect differs per rank (a tenant's purge: each rank's CPU tier holds its own
chunks) gathers the ranks' answers there with one `all_gather_object` over that same group,
so the reply reports every rank. Every rank reaches the gather: the caller answers each
failure as JSON rather than raise past it. With DP attention the control broadcast may use
another group, so nothing is gathered there (TP rank 0's answer stands for its group).
"""

from __future__ import annotations

import json
from typing import Any

from kvtier.integration.sglang.boundary.sglang_views import SchedulerView

__all__ = ["gather_ranks"]


def gather_ranks(scheduler: SchedulerView, ok: bool, message: str, key: str) -> tuple[bool, str]:
    """(every rank succeeded, this rank's JSON answer with `key` replaced by the list of each
    TP rank's `key`, or `{"error": ...}` where a rank failed), in TP rank order."""
    answers: list[Any] = [(ok, message)]
    if scheduler.tp_size > 1 and not scheduler.server_args.enable_dp_attention:
        import torch.distributed as dist

        answers = [None] * scheduler.tp_size
        dist.all_gather_object(answers, (ok, message), group=scheduler.tp_cpu_group)
    mine = json.loads(message)
    each = []
    for rank, (_, text) in enumerate(answers):
        answer = json.loads(text)
        each.append({"tp_rank": rank, **(answer[key] if key in answer
                                          else {"error": answer.get("error", "no answer")})})
    mine[key] = each
    return all(bool(a[0]) for a in answers), json.dumps(mine)
