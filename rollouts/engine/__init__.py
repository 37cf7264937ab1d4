"""The built-in engine server (`rollouts serve`): SGLang- and vLLM-compatible, on CPU or GPU.

Layout: `sampling` / `scheduler` / `wire` are pure (sampling transforms, admission and stop
decisions, request parsing); `kv` holds the shared left-padded KV cache; `core` is the worker
thread that runs the model (continuous batching); `state` bridges trio routes to the worker;
`sglang_routes` / `openai_routes` speak the two wire formats; `app` assembles and serves.

Logprobs: every route returns the logprob of each sampled token. Which distribution it comes from
is a server option, `--logprobs-from`:
  raw     (default) log_softmax of the model's unmodified logits at that step;
  scaled  log_softmax of the logits divided by the request's temperature (greedy rows: raw).
Neither includes top-k / top-p / min-p truncation, so a trainer recomputes the same quantity
from one teacher-forced forward pass (raw: `log_softmax(logits)`; scaled: `log_softmax(logits/T)`).
"""
