"""`gptkit serve`: the OpenAI HTTP API over a run, on the continuous-batching engine of gptkit.inference
(docs/serve.md)."""
