"""What a run computes on: the precision (precision.py), the CPU's threads (threads.py), the GPU
memory and disk a run needs (memory_plan.py), the optional vLLM sampler (vllm_engine.py), and the
processes that grade under a time limit (grading_pool.py)."""
