"""A request's span attributes after OpenTelemetry's GenAI semantic conventions (never the prompt)."""

from typing import Any

from router.protocol import ParsedRequest


def gen_ai_attributes(operation: str, model: str, parsed: ParsedRequest, request_id: str) -> dict[str, Any]:
    sampling = parsed.sampling
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": "pdserve",
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": sampling.max_tokens,
        "gen_ai.request.temperature": sampling.temperature,
        "gen_ai.request.top_p": sampling.top_p,
        "pdserve.request_id": request_id,
    }
    if sampling.seed is not None:
        attributes["gen_ai.request.seed"] = sampling.seed
    if sampling.n != 1:  # each choice's span carries it, with its own pdserve.choice.index
        attributes["gen_ai.request.choice.count"] = sampling.n
    if sampling.structured_output is not None:  # its kind only: a schema may hold the client's data
        attributes["pdserve.constraint.kind"] = sampling.structured_output.kind.value
    if parsed.tools is not None:
        attributes["pdserve.tool_choice"] = parsed.tools.choice
        attributes["pdserve.tools.count"] = len(parsed.tools.functions)
    return attributes
