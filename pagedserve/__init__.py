"""pagedserve: continuous batching over a paged KV cache, an OpenAI-compatible server, and the tools
that answer how much concurrency a GPU can take."""

from pagedserve.entrypoints.llm import LLM
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
