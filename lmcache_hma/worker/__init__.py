"""The worker half (each vLLM worker): the step protocol, loads, gathers, answering lookups, holding hits, the store writer."""
