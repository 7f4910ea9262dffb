"""The drvsoftmax benchmark, in small modules (entry point: ``benchmarks/bench_softmax.py``).

cases     what runs: the cases, their shapes and minimum bytes (pure Python)
peers     who runs it: drvsoftmax and every peer, what each can take, how it is called
timing    CUDA-event medians with input rotation, host time per call, the copy ceiling
runner    inputs, checks against a float32 reference, the sections, host/memory/cold start
report    rows, CSV, ratio and `ahead in N of M`, markdown summary and the PNG
"""
