"""The planner: hardware profiles, model registry, the Hierarchical Roofline Model and the policy MILP.

Modules (import what you need; nothing is imported eagerly so ``import lightning_moe.policy`` stays light):
  hardware   HardwareProfile (+ presets t4, l4, a100-40g, h100, h200), parse_bytes, resolve_hardware
  registry   real MoE configs as MoESpec, resolve_spec(name_or_dir)
  policy     Policy, Workload, Budgets, PlanInfeasible, format_table
  hrm        evaluate(policy, spec, hw, workload) -> Estimate, check_memory, memory_estimate
  milp       plan(spec, hw, workload, budgets, candidates=None) -> (Policy, Estimate), plan_scoring
  batching   length grouping of micro-batches and KV caches (KV_GROUPS, SCORE_CHUNK_TOKENS), torch-free
Measuring a host (``pipeline.profiler``) and the ``plan`` / ``profile`` commands (``plan_cli``) live outside: the
planner imports model.spec and nothing of the pipeline.
"""
