"""The engine link's errors: what crosses from the engine process keeps its type when the front can rebuild it
(so it maps to the same HTTP status), and becomes a RuntimeError with its name and message when it cannot."""

from __future__ import annotations

import pickle

import pytest

from hybridpd.engine.request import FinishReason, RequestOutput
from hybridpd.errors import EngineDeadError, InvalidRequestError, KVTransferError, ServerOverloadedError
from hybridpd.server.engine_link import Outputs, Rejected, portable_error, portable_outputs


class ForeignError(Exception):
    """A third-party error whose constructor does not take its message back (unpicklable as raised)."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"{code}: {detail}")


def roundtrip(value):
    return pickle.loads(pickle.dumps(value))


@pytest.mark.parametrize("error, kept", [
    (InvalidRequestError("prompt too long", param="prompt"), True),
    (KVTransferError("10.0.0.2:9100", "lease expired"), True),
    (ServerOverloadedError("busy"), True),
    (EngineDeadError("gone"), True),
    (ValueError("bad"), True),
    (ForeignError(7, "nixl"), False),
])
def test_portable_error(error, kept):
    sent = roundtrip(portable_error(error))
    if kept:
        assert type(sent) is type(error)
        assert str(sent) == str(error)
        assert vars(sent) == vars(error)     # InvalidRequestError.param, KVTransferError.peer / reason
    else:
        assert type(sent) is RuntimeError
        assert str(sent) == "ForeignError: 7: nixl"


def test_outputs_and_rejections_cross_whole():
    failed = RequestOutput(request_id="a", new_token_ids=(), new_text="", num_prompt_tokens=3, num_cached_tokens=0,
                           num_output_tokens=0, finished=True, finish_reason=FinishReason.ERROR,
                           error=ForeignError(1, "x"))
    fine = RequestOutput(request_id="b", new_token_ids=(5,), new_text="hi", num_prompt_tokens=3, num_cached_tokens=2,
                         num_output_tokens=1, kv_transfer_params={"remote_block_ids": [[1, 2]]})
    got = roundtrip(Outputs(portable_outputs([failed, fine])))
    assert got.outputs[1] == fine
    assert got.outputs[0] == failed        # errors are not compared: checked apart
    assert str(got.outputs[0].error) == "ForeignError: 1: x"
    rejected = roundtrip(Rejected("c", portable_error(InvalidRequestError("no", param="max_tokens"))))
    assert rejected.error.param == "max_tokens"
