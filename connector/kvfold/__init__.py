"""kvfold: serve compacted KV caches of long documents from vLLM.

    import kvfold
    p = kvfold.prompt("/caches/<model-fp>/<doc>.fold-0.1.kvf", question_ids, model="/models/qwen3")
    llm.generate({"prompt_token_ids": p.prompt_token_ids, "cache_salt": p.cache_salt},
                 SamplingParams(extra_args={"kv_transfer_params": p.kv_transfer_params}))
    # a cache made with `kvfold compact --chat`: the question as a user turn, the template from the file
    p = kvfold.prompt("/caches/<model-fp>/<doc>.fold-0.1.kvf", question="Who signed it?", model="/models/qwen3")

The vLLM side is kvfold.connector.KVFoldConnector (imported only by vLLM: it needs vllm and torch).
Importing kvfold itself loads the small C extension and nothing else (no torch, no CUDA).
See connector/README.md.
"""
from .prompt import Prompt, cache_key, cache_salt, check_tokenizer, placeholder_ids, prompt, tokenizer_digest

__version__ = "0.1.0"
__all__ = ["Prompt", "cache_key", "cache_salt", "check_tokenizer", "placeholder_ids", "prompt", "tokenizer_digest"]
