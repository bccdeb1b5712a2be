"""The decoding wing: one prompt's samples (generate, with the GPU's fixed-shape loop in static_decode), many
sequences at once (the continuous-batching loop in batcher, its steps in scheduler, its paged KV cache in
block_pool, or one slot a sequence in slot_cache, the thread that runs it for a server in engine),
objective=grpo's groups (rollouts), and what they share: choosing tokens and when to stop (sampling), the CPU
weight layout (decoding_layout). Usable from Python without HTTP:

    from gptkit.inference.generate import generate
    from gptkit.inference.sampling import SampleOptions
    g = generate(model, ids, SampleOptions(max_new_tokens=64, temperature=0))

    from gptkit.inference.batcher import SamplingParams, generate_many
    outs = generate_many(model, [ids_a, ids_b], SamplingParams(max_new_tokens=64, temperature=0))

    from gptkit.inference.engine import Engine
    with Engine(model, max_batch=16) as engine:
        handle = engine.submit(ids, SamplingParams(max_new_tokens=64), decode=tokenizer.decode)
        for event in handle: ...          # or handle.result()
"""
