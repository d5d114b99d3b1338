"""Code the tests share and the GPU benchmarks reuse: random-weight HF checkpoints of every family
(``make_checkpoint``), the CLI suite's data and job generators (``suite_jobs``), transformers references
(``hf_checkpoints``), prompt files (``prompt_files``) and the GPU kernel tests' inputs (``moe_inputs``).

Imported as ``tests.support.<module>`` from the repository root (pytest puts the root first on the import path
because ``tests/`` is a package; the benchmarks run from the root)."""
