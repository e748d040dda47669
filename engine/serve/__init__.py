"""The engine as a service: its own process (core), the one client front ends use, chat sessions,
and the bench workload it runs.

    protocol.py   messages and typed errors crossing the process boundary
    core.py       the engine process: an LLMEngine, its copies of the chat sessions, the step loop
    client.py     EngineClient / AsyncEngineClient: the only way front ends reach the engine
    session.py    chat sessions: the record that owns their state and its state machine (kept by the
                  client), a conversation tree's branches, and the engine's canonical token history
    bench.py      bench workloads (nano-vllm's bench.py, multi-turn chat), run by the core
"""
