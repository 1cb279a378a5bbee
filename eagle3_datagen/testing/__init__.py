"""Test and demo support: the scripted OpenAI-protocol fault-injection server, the tiny-model builder and the
local vLLM CPU server. Installed with the `testing` extra; the runtime (core, stages, flows) imports none of it.
"""
