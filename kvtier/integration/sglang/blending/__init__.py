"""Blended prefill on SGLang (`enable_blending`): the blender, each request's segment chains,
blends computed off the scheduler thread, segments warmed and verified in the background."""
