"""pdserve: LLM serving with prefill/decode disaggregation."""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):
    # Lazy so `import pdserve` (e.g. for the CLI's --help or the KV transfer engine) does not import torch models.
    if name == "LLM":
        from pdserve.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pdserve.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
