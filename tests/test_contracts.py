"""The contract dataclasses and their gRPC form stay in step: every field is on the wire under a
known name, or listed here as deliberately off it."""

from __future__ import annotations

import dataclasses

import pytest

from hearth.proto import hearth_pb2
from hearth.proto.contracts import GenerationChunk, ModelInfo, RequestMetrics, SamplingParams, TokenLogprob

# dataclass -> (proto message, {field: proto field, or None when it does not travel})
MIRRORS = {
    SamplingParams: (hearth_pb2.SamplingParams, {}),
    GenerationChunk: (hearth_pb2.GenerateResponse, {
        "request_id": None,  # the stream is the request
        "finished": "finish_reason",  # set on the last response only
        "stop_reason": "stop_sequence",  # the stop string (a stop token id is in token_ids)
        "metrics": "usage",  # counts in Usage, speeds in timings (see RequestMetrics)
    }),
    RequestMetrics: (hearth_pb2.Usage, {
        "num_prompt_tokens": "prompt_tokens", "num_output_tokens": "completion_tokens",
        "num_cached_tokens": "cached_tokens",
        # The times arrive as the llama.cpp-style speeds of GenerateResponse.timings.
        "arrival": None, "first_scheduled": None, "first_token": None, "finished": None,
    }),
    TokenLogprob: (hearth_pb2.TokenLogprob, {}),
    ModelInfo: (hearth_pb2.ModelCard, {"name": "id", "path": None, "vocab_size": None}),
}
EXTRA_WIRE_FIELDS = {hearth_pb2.GenerateResponse: {"timings"}}  # derived from a dataclass's method


@pytest.mark.parametrize("cls", list(MIRRORS), ids=lambda c: c.__name__)
def test_every_field_has_its_wire_form(cls):
    message, renames = MIRRORS[cls]
    wire = {f.name for f in message.DESCRIPTOR.fields}
    mapped = {f.name: renames.get(f.name, f.name) for f in dataclasses.fields(cls)}
    missing = {name: target for name, target in mapped.items() if target is not None and target not in wire}
    assert not missing, f"{cls.__name__} fields without a {message.DESCRIPTOR.name} field: {missing}"
    unmapped = wire - set(mapped.values()) - EXTRA_WIRE_FIELDS.get(message, set())
    assert not unmapped, f"{message.DESCRIPTOR.name} fields no {cls.__name__} field maps to: {unmapped}"


def test_timings_keys_are_what_the_wire_carries():
    keys = set(RequestMetrics(arrival=1.0, first_token=2.0, finished=3.0, num_output_tokens=4).timings())
    assert {"prompt_per_second", "predicted_per_second", "prompt_n", "predicted_n"} <= keys


def test_merged_chunks_keep_tokens_text_and_final_state():
    a = GenerationChunk("r", [1, 2], "ab", metrics=RequestMetrics(first_token=5.0))
    b = GenerationChunk("r", [3], "c", True, "stop", "STOP", RequestMetrics(first_token=5.0, num_output_tokens=3))
    merged = GenerationChunk.merge([a, b])
    assert merged.token_ids == [1, 2, 3] and merged.text == "abc" and merged.finished
    assert merged.stop_reason == "STOP" and merged.metrics.num_output_tokens == 3
