"""Decoding many sequences at once: the continuous-batching loop (batcher), its KV cache (slot_cache) and the
thread that runs it for a server (engine). Usable from Python without HTTP:

    from gptkit.inference.batcher import SamplingParams, generate_many
    outs = generate_many(model, [ids_a, ids_b], SamplingParams(max_new_tokens=64, temperature=0))

    from gptkit.inference.engine import Engine
    with Engine(model, max_batch=16) as engine:
        handle = engine.submit(ids, SamplingParams(max_new_tokens=64), decode=tokenizer.decode)
        for event in handle: ...          # or handle.result()
"""
