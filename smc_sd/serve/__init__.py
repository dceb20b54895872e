"""`smc-sd serve`: an OpenAI-compatible HTTP server over the batched engine.

Modules, in the order a request passes through them: `launch` (flags, models, socket, uvicorn),
`app` (routes, the engine's loop thread), `parsing` (a body into prompts, program settings and
seeds; `fields` reads typed fields, `structured` the constraints), `runs` (a request's children
on the engine and their events), `text` (stop strings and stream deltas), `responses` (OpenAI's
answer and chunk shapes, the `smc` object), `metrics` (Prometheus text), `errors` (OpenAI's
error shape). docs/serve.md describes the API.
"""
