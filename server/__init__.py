"""mlaserve's serving stack: engine, scheduler, runner, HTTP API, CLI."""

from server.sampling_params import SamplingParams


def __getattr__(name):
    # LLM pulls in the model and torch; import it lazily so `import server` stays cheap.
    if name == "LLM":
        from server.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams"]
