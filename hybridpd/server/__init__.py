"""The node's OpenAI-compatible HTTP server (aiohttp): parse, hand to the engine, shape answers like vLLM's."""
