"""The llama.cpp engine: the ONLY package that imports llama_cpp.

``model`` loads a GGUF (staging, memory plan, offload, saved states), ``prompts`` turns requests
into tokens (template, chat sessions), ``batch`` runs them (slots, admission, one batch a step).
"""

from phi4cli.daemon.llama.batch import LlamaEngine

__all__ = ["LlamaEngine"]
