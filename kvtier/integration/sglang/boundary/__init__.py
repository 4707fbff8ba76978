"""The typed SGLang boundary: every SGLang internal kvtier relies on (`sglang_api`), the
`Protocol` views of the SGLang objects it reads (`sglang_views`), and the canary that checks
them against the installed SGLang (`sglang_canary`)."""
