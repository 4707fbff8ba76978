"""Test-only SGLang plugin (entry point `kvtier_test_fixes`): CPU fixes for tiny test models.

Under `--attention-backend torch_native` SGLang's DeepSeek dispatcher has no handler and falls
back to the Triton one, which picks the MHA path for a prefix-free prefill; on the CPU
torch_native backend that path fails on MLA shapes. Dispatching every torch_native forward to
the MLA method (which torch_native implements) makes tiny DeepSeek-style models serve on CPU.
"""

from __future__ import annotations

from typing import Any


def register() -> None:
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
    )
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod,
    )

    def torch_native_mla(attn: Any, forward_batch: Any) -> AttnForwardMethod:
        return AttnForwardMethod.MLA

    AttentionBackendRegistry.register("torch_native", torch_native_mla)
