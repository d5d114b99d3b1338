"""The application layer: a job run end to end (``engine``), planned before any weight is read (``plan``), on a
GPU capped to the job's ``gpu_memory`` (``gpu``), reported (``report``).

It sits between the command line and the execution machinery: cli -> app -> pipeline -> (policy, model, kernels);
nothing below it imports it (tests/test_layering.py).
"""
