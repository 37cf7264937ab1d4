"""A per-sample OpenAI-compatible gateway in front of the run's engines.

An agent written against the OpenAI chat API (`openai.AsyncOpenAI(base_url=...)`, `tools`,
several turns) trains unchanged: each sample's agent gets its own `base_url`, every call is
served by the engine pool token in / token out, and the sample is the episode's exact tokens.
Modules: `wire.py` (the request and answer, pure), `session.py` (the episode record and its
append-only rule, pure), `calls.py` (one call), `app.py` (the HTTP server and its sessions),
`generate.py` (the generate function and the sample).
"""

from __future__ import annotations

from rollouts.gateway.app import Gateway, open_gateway
from rollouts.gateway.generate import AgentFn, AgentGenerate, agent_generate, open_agent_generate

__all__ = [
    "AgentFn",
    "AgentGenerate",
    "Gateway",
    "agent_generate",
    "open_agent_generate",
    "open_gateway",
]
