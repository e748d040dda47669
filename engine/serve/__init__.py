"""The engine as a service: its own process (core), the one client front ends use, chat sessions,
and the bench workload it runs.

    protocol.py   messages and typed errors crossing the process boundary
    core.py       the engine process: an LLMEngine, its chat sessions, the step loop
    client.py     EngineClient / AsyncEngineClient: the only way front ends reach the engine
    session.py    chat sessions with canonical token histories (live in the engine process)
    bench.py      bench workloads (nano-vllm's bench.py, multi-turn chat), run by the core
"""
