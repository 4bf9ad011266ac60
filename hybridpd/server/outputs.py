"""One request's outputs, as `engine.generate()` yields them, with the one rule for ending the generator."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from hybridpd.engine.request import RequestOutput


class EngineOutputs:
    """`next()` until an output has `finished=True`; `close()` always, in a `finally`.

    close() after the finished output lets the generator run to its own end (the engine sees a normal finish);
    close() before it calls `aclose()`, which the engine takes as an abort (the client went away or the
    request failed here), freeing the request's blocks.
    """

    def __init__(self, generator: AsyncGenerator[RequestOutput, None]) -> None:
        self._generator = generator
        self.finished = False

    async def next(self) -> RequestOutput:
        output = await anext(self._generator, None)
        if output is None:
            raise RuntimeError("the engine's outputs ended before the request finished")
        self.finished = output.finished
        return output

    async def close(self) -> None:
        if self.finished:
            await anext(self._generator, None)
        await self._generator.aclose()
